"""The runtime contract: every backend passes these tests by subclassing
:class:`RuntimeContract` and providing a ``runtime`` fixture (and ``make_runtime``, a
factory for a second instance over the same state, standing for a restarted service).

The suite speaks only the interface in ``shared.runtime.api``; nothing here knows how a
backend works.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from sbx_api import errors
from shared.runtime import api


def new_id() -> str:
    return "sb-" + uuid.uuid4().hex[:12]


class RuntimeContract:
    """Subclass and provide ``runtime`` (an api.Runtime) and ``make_runtime`` fixtures."""

    @pytest.fixture
    async def running(self, runtime):
        spec = api.SandboxSpec(sandbox_id=new_id(), labels={"suite": "contract"})
        await runtime.create(spec)
        await runtime.start(spec.sandbox_id)
        yield spec.sandbox_id
        await runtime.delete(spec.sandbox_id)

    async def test_create_is_idempotent_and_checks_its_input(self, runtime):
        spec = api.SandboxSpec(sandbox_id=new_id())
        first = await runtime.create(spec)
        assert first.status == "created" and first.sandbox_id == spec.sandbox_id
        assert (await runtime.create(spec)).created_at == first.created_at
        with pytest.raises(errors.Conflict):
            await runtime.create(api.SandboxSpec(sandbox_id=spec.sandbox_id, run_as_root=False))
        with pytest.raises(errors.InvalidInput):
            await runtime.create(api.SandboxSpec(sandbox_id="../escape"))
        with pytest.raises(errors.InvalidInput):
            await runtime.create(api.SandboxSpec(sandbox_id=new_id(), image="No Such Image"))
        await runtime.delete(spec.sandbox_id)

    async def test_exec_streams_output_and_returns_the_exit_code(self, runtime, running):
        result, out, err = await runtime.run(running, ["sh", "-c", "echo out; echo err >&2; exit 7"])
        assert (result.exit_code, out, err) == (7, b"out\n", b"err\n")
        result, out, _ = await runtime.run(running, ["cat"], stdin=b"\x00\xffbinary\n")
        assert result.exit_code == 0 and out == b"\x00\xffbinary\n"
        result, out, _ = await runtime.run(
            running, ["sh", "-c", 'echo "$GREETING"; pwd'], env={"GREETING": "hi"}
        )
        assert out.splitlines()[0] == b"hi"
        _, out, _ = await runtime.run(running, ["pwd"], cwd="/tmp")
        assert out == b"/tmp\n"

    async def test_output_arrives_while_the_command_runs(self, runtime, running):
        script = "echo first; while [ ! -e /tmp/go ]; do sleep 0.05; done; echo second"
        execution = await runtime.exec(running, ["sh", "-c", script])
        chunks = execution.chunks()
        stream, data = await asyncio.wait_for(chunks.__anext__(), 10)
        assert (stream, data) == ("stdout", b"first\n")
        waiting = asyncio.ensure_future(execution.wait())
        await asyncio.sleep(0.2)
        assert not waiting.done(), "the command is still running: the first line streamed before it ended"
        await runtime.run(running, ["touch", "/tmp/go"])
        rest = b"".join([d async for _, d in chunks])
        assert rest == b"second\n"
        assert (await waiting).exit_code == 0

    async def test_a_long_lived_command_reads_stdin_as_it_is_sent(self, runtime, running):
        """``keep_stdin_open``: what the executor's persistent shell server is built on."""
        helper = await runtime.exec(
            running, ["sh", "-c", "while read -r x; do echo got $x; done"], keep_stdin_open=True
        )
        chunks = helper.chunks()
        for word in ("one", "two"):
            await helper.send(word.encode() + b"\n")
            assert await asyncio.wait_for(chunks.__anext__(), 10) == ("stdout", f"got {word}\n".encode())
        await helper.close_stdin()
        assert [d async for _, d in chunks] == []
        assert (await asyncio.wait_for(helper.wait(), 10)).exit_code == 0
        with pytest.raises(errors.Unavailable):
            for _ in range(100):  # the pipe may take a write or two before it reports the reader gone
                await helper.send(b"more\n")
        once = await runtime.exec(running, ["cat"], stdin=b"x")
        with pytest.raises(errors.InvalidInput):
            await once.send(b"y")
        await once.wait()

    async def test_timeout_kills_the_command(self, runtime, running):
        result, _, _ = await runtime.run(running, ["sh", "-c", "sleep 30; echo never"], timeout=0.5)
        assert result.timed_out and result.exit_code == -1
        _, out, _ = await runtime.run(running, ["sh", "-c", "ps -e -o comm= | grep -c '^sleep$' || true"])
        assert out.strip() == b"0"

    async def test_stop_keeps_the_workspace_and_start_brings_it_back(self, runtime, running):
        await runtime.run(running, ["sh", "-c", "echo kept > /workspace/file"])
        stopped = await runtime.stop(running)
        assert stopped.status == "stopped" and (await runtime.get(running)).status == "stopped"
        with pytest.raises(errors.Conflict):
            await runtime.exec(running, ["true"])
        assert (await runtime.start(running)).status == "running"
        _, out, _ = await runtime.run(running, ["cat", "/workspace/file"])
        assert out == b"kept\n"

    async def test_list_finds_sandboxes_by_label(self, runtime, running):
        found = await runtime.list({"suite": "contract"})
        assert running in {i.sandbox_id for i in found}
        assert running not in {i.sandbox_id for i in await runtime.list({"suite": "other"})}

    async def test_delete_removes_everything_and_is_idempotent(self, runtime):
        spec = api.SandboxSpec(sandbox_id=new_id())
        await runtime.create(spec)
        await runtime.start(spec.sandbox_id)
        await runtime.delete(spec.sandbox_id)
        assert await runtime.get(spec.sandbox_id) is None
        await runtime.delete(spec.sandbox_id)
        with pytest.raises(errors.NotFound):
            await runtime.exec(spec.sandbox_id, ["true"])
        with pytest.raises(errors.NotFound):
            await runtime.start(spec.sandbox_id)

    async def test_a_restarted_service_finds_its_sandboxes(self, runtime, make_runtime, running):
        await runtime.run(running, ["sh", "-c", "echo state > /workspace/mark"])
        fresh = make_runtime()
        info = await fresh.get(running)
        assert info is not None and info.status == "running"
        _, out, _ = await fresh.run(running, ["cat", "/workspace/mark"])
        assert out == b"state\n"

    async def test_runs_as_root_by_default_and_as_a_user_when_asked(self, runtime):
        root = api.SandboxSpec(sandbox_id=new_id())
        user = api.SandboxSpec(sandbox_id=new_id(), run_as_root=False, writable_root=False)
        for spec in (root, user):
            await runtime.create(spec)
            await runtime.start(spec.sandbox_id)
        try:
            _, out, _ = await runtime.run(root.sandbox_id, ["id", "-u"])
            assert out == b"0\n"
            r, _, _ = await runtime.run(root.sandbox_id, ["sh", "-c", "touch /usr/local/installed"])
            assert r.exit_code == 0, "writable root by default"
            _, out, _ = await runtime.run(user.sandbox_id, ["id", "-u"])
            assert out != b"0\n"
            r, _, _ = await runtime.run(user.sandbox_id, ["sh", "-c", "touch /usr/local/installed"])
            assert r.exit_code != 0, "read-only root when writable_root=False"
            r, _, _ = await runtime.run(user.sandbox_id, ["sh", "-c", "touch /workspace/mine"])
            assert r.exit_code == 0, "the workspace is writable for the sandbox user"
        finally:
            for spec in (root, user):
                await runtime.delete(spec.sandbox_id)

    # ---- pause and resume ---------------------------------------------------------------

    async def test_pause_is_available_or_refused_plainly(self, runtime, running):
        """A backend that cannot pause says so with the product's "not built" error (501)
        and leaves the sandbox running; one that can pauses and resumes idempotently."""
        if not runtime.pausable:
            with pytest.raises(errors.NotBuiltYet, match="not available on the .* runtime yet"):
                await runtime.pause(running)
            with pytest.raises(errors.NotBuiltYet):
                await runtime.resume(running)
            assert (await runtime.get(running)).status == "running"
            return
        assert (await runtime.pause(running)).status == "paused"
        assert (await runtime.pause(running)).status == "paused"  # idempotent
        assert (await runtime.get(running)).status == "paused" and await runtime.paused(running)
        with pytest.raises(errors.NotRunning, match="paused"):
            await runtime.exec(running, ["true"])
        assert (await runtime.resume(running)).status == "running"
        assert (await runtime.resume(running)).status == "running"  # idempotent
        assert not await runtime.paused(running)
        _, out, _ = await runtime.run(running, ["echo", "back"])
        assert out == b"back\n"

    async def test_a_paused_sandbox_runs_nothing_and_goes_on_where_it_was(self, runtime, running):
        """A background process's ticks (each the time it ran) show none while paused, and
        go on after: its memory and files are as they were."""
        if not runtime.pausable or not runtime.pause_keeps_processes:
            pytest.skip(f"the {runtime.name} runtime cannot pause with processes kept")
        ticker = 'i=0; while :; do i=$((i+1)); echo "$i $(date +%s.%N)" >> /workspace/ticks; sleep 0.02; done'
        await runtime.run(running, ["sh", "-c", f"({ticker}) >/dev/null 2>&1 </dev/null &"])
        await _until(lambda: _ticks(runtime, running), lambda t: len(t) >= 3)
        await runtime.pause(running)
        paused_at = await _clock(runtime)
        await asyncio.sleep(0.3)
        resumed_at = await _clock(runtime)
        await runtime.resume(running)
        after = await _until(lambda: _ticks(runtime, running), lambda t: t[-1][1] > resumed_at)
        assert not [t for t in after if paused_at < t[1] < resumed_at], "a tick ran while paused"
        counts = [n for n, _ in after]
        assert counts == list(range(1, len(counts) + 1)), "the counter went on from where it was"
        await runtime.stop(running)  # stopping a paused-then-resumed sandbox works as ever
        assert (await runtime.get(running)).status == "stopped"

    async def test_a_paused_sandbox_stops_and_deletes(self, runtime):
        if not runtime.pausable:
            pytest.skip(f"the {runtime.name} runtime cannot pause")
        spec = api.SandboxSpec(sandbox_id=new_id())
        await runtime.create(spec)
        await runtime.start(spec.sandbox_id)
        await runtime.run(
            spec.sandbox_id,
            ["sh", "-c", "echo kept > /workspace/f; (sleep 600 >/dev/null 2>&1 </dev/null &)"],
        )
        await runtime.pause(spec.sandbox_id)
        assert (await runtime.stop(spec.sandbox_id)).status == "stopped"
        assert (await runtime.start(spec.sandbox_id)).status == "running"
        _, out, _ = await runtime.run(
            spec.sandbox_id, ["sh", "-c", "cat /workspace/f; pgrep -c sleep || true"]
        )
        assert out == b"kept\n0\n"
        await runtime.pause(spec.sandbox_id)
        await runtime.delete(spec.sandbox_id)
        assert await runtime.get(spec.sandbox_id) is None

    # ---- resource usage -----------------------------------------------------------------

    async def test_usage_is_read_or_refused_plainly(self, runtime, running):
        """A backend reads a sandbox's CPU, memory and disk use with its limits, or says it
        does not with the product's "not built" error (501)."""
        try:
            idle = await runtime.usage(running, window=0.01)
        except errors.NotBuiltYet as exc:
            assert f"not read by the {runtime.name} runtime" in str(exc)
            return
        limits = api.Limits()
        assert (idle.cpus, idle.memory_limit) == (limits.cpus, limits.memory_bytes)
        assert 0 < idle.memory_bytes <= idle.memory_limit
        assert 0 <= idle.memory_cache_bytes <= idle.memory_bytes
        await runtime.run(running, ["sh", "-c", "(while :; do :; done) >/dev/null 2>&1 </dev/null &"])
        busy = await runtime.usage(running, window=1.0)
        assert 0 < busy.cpu_percent <= 100 and busy.cpu_seconds > idle.cpu_seconds
        assert busy.at > idle.at
        with pytest.raises(errors.NotFound):
            await runtime.usage(new_id())
        await runtime.stop(running)
        with pytest.raises(errors.NotRunning):
            await runtime.usage(running)


async def _ticks(runtime: api.Runtime, sandbox_id: str) -> list[tuple[int, float]]:
    _, out, _ = await runtime.run(sandbox_id, ["cat", "/workspace/ticks"])
    rows = [line.split() for line in out.decode().splitlines()]
    return [(int(n), float(t)) for n, t in (r for r in rows if len(r) == 2)]


async def _clock(runtime: api.Runtime) -> float:
    """The wall clock (sandboxes share the host's)."""
    import time

    return time.time()


async def _until(get, ok, timeout: float = 30.0):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = await get()
        if ok(value) or loop.time() > deadline:
            assert ok(value), value
            return value
        await asyncio.sleep(0.02)
