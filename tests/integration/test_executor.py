"""Sessions running real commands in real sandboxes: scheduler, pool-manager and executor
(in-process here, as processes where a kill matters) over a real nats-server."""

from __future__ import annotations

import asyncio
import signal

import pytest

from services.executor import app as executor_app
from services.pool_manager import app as pool_app
from services.scheduler import app as scheduler_app
from shared.contract import codec, commands, execution, ids, provisioning, subjects
from shared.infrastructure.settings import runtime as runtime_settings
from tests import support

pytestmark = [pytest.mark.needs_root("the local runtime needs root"), pytest.mark.slow]
RUNTIME = runtime_settings.RuntimeSettings(memory_bytes=512 * 1024**2, output_limit=4096)


@pytest.fixture
async def stack(nats_server, namespace, tmp_path):
    state = tmp_path / "state"
    running = [
        await support.start_in_process(
            nats_server.url, namespace, "scheduler", scheduler_app.setup, state_dir=state
        ),
        await support.start_in_process(
            nats_server.url, namespace, "pool-manager", pool_app.make_setup(RUNTIME), state_dir=state
        ),
        await support.start_in_process(
            nats_server.url, namespace, "executor", executor_app.make_setup(RUNTIME), state_dir=state
        ),
    ]
    nc, topology = await support.connect(nats_server.url, namespace)
    yield Client(nc, topology)
    await nc.close()
    for r in reversed(running):
        await r.stop()
    from shared.runtime.local import runtime as local

    rt = local.LocalRuntime(state)
    for info in await rt.list():
        await rt.delete(info.sandbox_id)
    rt.caches.detach_all()


class Client:
    """What the gateway does, minus HTTP: ensure the session, then send execution requests."""

    def __init__(self, nc, topology) -> None:
        self.nc, self.topology = nc, topology

    async def ensure(self, session: str, **kw) -> commands.CommandReply:
        reply = await support.send(
            self.nc,
            self.topology,
            commands.EnsureSession(command_id=ids.new_id(), session_id=session, **kw),
            timeout=60,
        )
        assert reply.ok, reply.error
        return reply

    async def run(self, session: str, request_type, wait: float = 120, **fields) -> execution.Reply:
        sandbox = (await self.ensure(session)).session.sandbox_id
        request = request_type(session_id=session, sandbox_id=sandbox, **fields)
        msg = await self.nc.request(self.topology.exec_requests, codec.encode(request), timeout=wait)
        return execution.decode_reply(msg.data)

    async def sh(self, session: str, command: str, **kw) -> execution.Reply:
        reply = await self.run(session, execution.Shell, command=command, **kw)
        assert reply.ok, reply.error
        return reply


async def test_first_use_creates_the_sandbox_and_records_it(stack):
    first = await stack.ensure("s1")
    again = await stack.ensure("s1")
    assert first.session.sandbox_id and again.session.sandbox_id == first.session.sandbox_id
    history = await support.stream_events(stack.nc, stack.topology)
    types = [
        s.event.__struct_config__.tag
        for s in history
        if not s.event.__struct_config__.tag.startswith("instance")
    ]
    # The sandbox first; then the session is created with it, in one append.
    assert types == ["sandbox.requested", "sandbox.started", "session.created", "session.sandbox_assigned"]


async def test_the_shell_keeps_cwd_and_variables_between_calls(stack):
    await stack.sh("s", "mkdir -p /workspace/proj && cd /workspace/proj && export GREETING=hello && LOCAL=x")
    reply = await stack.sh("s", 'pwd; echo "$GREETING"; echo "[$LOCAL]"; env | grep -c "^LOCAL=" || true')
    assert reply.output.splitlines() == ["/workspace/proj", "hello", "[x]", "0"]  # LOCAL stays unexported
    assert reply.exit_code == 0


async def test_exit_codes_timeouts_truncation_and_binary(stack):
    assert (await stack.sh("s", "exit 3")).exit_code == 3
    assert (await stack.sh("s", "echo still here")).output == "still here\n"
    slow = await stack.sh("s", "sleep 20", timeout=0.5)
    assert slow.timed_out and slow.exit_code is None and "timed out" in slow.output
    big = await stack.sh("s", "seq 1 100000")
    assert big.truncated and "output truncated" in big.output and big.output.rstrip().endswith("100000")
    assert len(big.output) < 6000
    binary = await stack.sh("s", "head -c 3000 /dev/urandom")
    assert "binary output" in binary.output
    odd = await stack.sh("s", r"printf 'caf\351 \000 ok\n'")  # latin-1 and a NUL in text
    assert odd.output == "caf\\xe9 \\x00 ok\n\n[2 byte(s) that are not UTF-8 text shown as \\xNN]"
    long_line = await stack.sh("s", "head -c 400000 /dev/zero | tr '\\0' a; echo; echo end")
    assert long_line.truncated and long_line.output.startswith("aaa")
    assert long_line.output.endswith("a\nend\n")
    merged = await stack.sh("s", "echo out; echo err >&2")
    assert merged.output == "out\nerr\n"


async def test_async_jobs_run_report_and_stop_their_whole_tree(stack):
    started = await stack.run("s", execution.ShellAsync, command="echo begin; sleep 0.3; echo done; exit 4")
    assert started.ok and started.status == "running" and len(started.job_id) == 32
    waited = await stack.run("s", execution.ShellWait, job_id=started.job_id, timeout=30)
    assert (waited.status, waited.exit_code, waited.output) == ("exited", 4, "begin\ndone\n")

    tree = await stack.run("s", execution.ShellAsync, command="sleep 300 & sleep 300 & echo up; wait")
    polled = await stack.run("s", execution.ShellPoll, job_id=tree.job_id)
    assert polled.status == "running"
    stopped = await stack.run("s", execution.ShellStop, job_id=tree.job_id)
    assert stopped.status == "stopped"
    left = await stack.sh("s", "ps -e -o comm= | grep -c '^sleep$' || true")
    assert left.output.strip() == "0"
    missing = await stack.run("s", execution.ShellPoll, job_id="0" * 32)
    assert not missing.ok and missing.error.code == "not_found"
    bad = await stack.run("s", execution.ShellPoll, job_id="../../etc")
    assert not bad.ok and bad.error.code == "invalid_input"


async def test_jobs_take_input_signals_and_are_listed_with_their_pids(stack):
    """The job operations the E2B processes are built on, as any caller of the executor
    sees them: a job with its own directory, env and stdin; input, end of input, signals."""
    await stack.sh("j", "export FROM_SESSION=1")
    reader = await stack.run(
        "j",
        execution.ShellAsync,
        command='cat; echo "$PWD $MINE ${FROM_SESSION:-none}" >&2',
        cwd="/tmp",
        env={"MINE": "m"},
        stdin=True,
        split=True,
        label='{"any": "note"}',
    )
    assert reader.ok and reader.pid and reader.pid > 1, reader.error
    running = await stack.run("j", execution.ShellJobs)
    assert [(j.job_id, j.pid, j.label) for j in running.jobs] == [
        (reader.job_id, reader.pid, '{"any": "note"}')
    ]
    for data in (b"one\n", b"\0two\n"):
        assert (await stack.run("j", execution.ShellInput, job_id=reader.job_id, data=data)).ok
    assert (await stack.run("j", execution.ShellInput, job_id=reader.job_id, close=True)).ok
    done = await stack.run("j", execution.ShellWait, job_id=reader.job_id, timeout=30)
    assert (done.status, done.exit_code) == ("exited", 0)
    assert (
        await stack.sh("j", f"cat /.sbx/jobs/{reader.job_id}/out")
    ).output == "one\n\\x00two\n\n[1 byte(s) that are not UTF-8 text shown as \\xNN]"
    assert (await stack.sh("j", f"cat /.sbx/jobs/{reader.job_id}/err")).output == "/tmp m none\n"
    late = await stack.run("j", execution.ShellInput, job_id=reader.job_id, data=b"x")
    assert not late.ok and late.error.code == "conflict"

    plain = await stack.run("j", execution.ShellAsync, command="echo $FROM_SESSION; sleep 300")
    assert (await stack.run("j", execution.ShellPoll, job_id=plain.job_id)).status == "running"
    refused = await stack.run("j", execution.ShellInput, job_id=plain.job_id, data=b"x")
    assert not refused.ok and refused.error.code == "invalid_input"  # started without stdin
    assert (await stack.run("j", execution.ShellSignal, job_id=plain.job_id, signal="KILL")).ok
    killed = await stack.run("j", execution.ShellWait, job_id=plain.job_id, timeout=30)
    assert (killed.status, killed.output) == ("stopped", "1\n")  # the session's exports: kept
    again = await stack.run("j", execution.ShellSignal, job_id=plain.job_id, signal="TERM")
    assert not again.ok and again.error.code == "not_found"
    assert (await stack.run("j", execution.ShellJobs)).jobs == []
    nowhere = await stack.run("j", execution.ShellAsync, command="true", cwd="/no/such/dir")
    assert not nowhere.ok and nowhere.error.code == "invalid_input"


async def test_file_operations_on_any_path(stack):
    async def files(**kw):
        reply = await stack.run("f", execution.Files, **kw)
        assert reply.ok, reply.error
        return reply

    assert (await files(action="mkdir", path="/tmp/f/a/b")).created is True
    assert (await files(action="mkdir", path="/tmp/f/a/b")).created is False
    await stack.sh("f", "printf 12345 > /tmp/f/a/x; ln -s x /tmp/f/a/l; touch '/tmp/f/a/new\nline'")
    listed = {e.path: e for e in (await files(action="list", path="/tmp/f", depth=3)).entries}
    assert set(listed) == {"/tmp/f/a", "/tmp/f/a/b", "/tmp/f/a/x", "/tmp/f/a/l", "/tmp/f/a/new\nline"}
    assert (listed["/tmp/f/a/x"].kind, listed["/tmp/f/a/x"].size) == ("file", 5)
    assert (listed["/tmp/f/a/l"].kind, listed["/tmp/f/a/l"].target) == ("symlink", "x")
    assert [e.path for e in (await files(action="list", path="/tmp/f")).entries] == ["/tmp/f/a"]
    moved = await files(action="move", path="/tmp/f/a/x", destination="/tmp/g/y")
    assert [(e.path, e.kind) for e in moved.entries] == [("/tmp/g/y", "file")]
    assert (await files(action="stat", path="/tmp/f/a/x")).exists is False
    assert (await files(action="remove", path="/tmp/f")).ok
    assert (await files(action="stat", path="/tmp/f")).exists is False
    not_dir = await stack.run("f", execution.Files, action="list", path="/tmp/g/y")
    assert not not_dir.ok and not_dir.error.code == "invalid_input"


async def test_the_edit_tool(stack):
    async def edit(**kw):
        return await stack.run("e", execution.Edit, **kw)

    created = await edit(command="create", path="/workspace/app.py", file_text="a = 1\nb = 2\na = 1\n")
    assert created.ok, created.error
    view = await edit(command="view", path="/workspace/app.py", view_range=[2, -1])
    assert view.output == "     2\tb = 2\n     3\ta = 1"
    several = await edit(command="str_replace", path="/workspace/app.py", old_str="a = 1", new_str="a = 9")
    assert not several.ok and "[1, 3]" in several.error.message
    none = await edit(command="str_replace", path="/workspace/app.py", old_str="zzz", new_str="y")
    assert not none.ok and "did not appear" in none.error.message
    done = await edit(command="str_replace", path="/workspace/app.py", old_str="b = 2", new_str="b = 3")
    assert done.ok and "b = 3" in done.output
    inserted = await edit(command="insert", path="/workspace/app.py", insert_line=0, new_str="# top")
    assert inserted.ok
    assert (await stack.sh("e", "cat /workspace/app.py")).output == "# top\na = 1\nb = 3\na = 1\n"
    out_of_range = await edit(command="view", path="/workspace/app.py", view_range=[9, 12])
    assert not out_of_range.ok and "out of bounds" in out_of_range.error.message
    await stack.sh("e", "head -c 100 /dev/urandom > /workspace/blob; printf '\\0' >> /workspace/blob")
    binary = await edit(command="view", path="/workspace/blob")
    assert not binary.ok and "binary" in binary.error.message
    listing = await edit(command="view", path="/workspace")
    assert listing.ok and "/workspace/app.py" in listing.output
    relative = await edit(command="view", path="app.py")
    assert not relative.ok and "absolute" in relative.error.message


async def test_two_sessions_never_see_each_other(stack):
    await stack.sh("alice", "echo secret > /workspace/alice.txt; export TOKEN=alice")
    bob = await stack.sh("bob", 'cat /workspace/alice.txt 2>&1; echo "[$TOKEN]"; ls /workspace')
    assert "secret" not in bob.output and "[]" in bob.output
    alice_sandbox = (await stack.ensure("alice")).session.sandbox_id
    sneaky = execution.Shell(session_id="bob", sandbox_id=alice_sandbox, command="cat /workspace/alice.txt")
    msg = await stack.nc.request(stack.topology.exec_requests, codec.encode(sneaky), timeout=30)
    reply = execution.decode_reply(msg.data)
    assert not reply.ok and reply.error.code == "not_found"


async def test_executions_are_audited_without_outputs(stack):
    await stack.sh("audited", "echo classified-output")
    records = [
        s.event
        for s in await support.stream_events(stack.nc, stack.topology, subjects.EXEC)
        if s.event.session_id == "audited"
    ]
    assert [(r.tool, r.command, r.exit_code, r.outcome) for r in records] == [
        ("shell", "echo classified-output", 0, "ok")
    ]
    assert "classified-output\n" not in codec.encode(records[0]).decode().replace(
        "echo classified-output", ""
    )


async def test_clear_session_then_the_same_id_starts_fresh(stack):
    await stack.sh("c", "echo old > /workspace/file; export OLD=1")
    first = (await stack.ensure("c")).session.sandbox_id
    cleared = await support.send(
        stack.nc, stack.topology, commands.ClearSession(command_id=ids.new_id(), session_id="c")
    )
    assert cleared.ok
    reply = await stack.sh("c", 'ls /workspace; echo "[$OLD]"')
    assert reply.output == "[]\n"
    assert (await stack.ensure("c")).session.sandbox_id != first
    again = await support.send(
        stack.nc, stack.topology, commands.ClearSession(command_id=ids.new_id(), session_id="nobody")
    )
    assert again.ok


async def test_executor_killed_mid_session_loses_nothing(nats_server, namespace, tmp_path, log_dir):
    """The executor runs as a process; it is SIGKILLed while a shell call is in flight and a
    job is running. A fresh executor still has the shell's cwd/env and the job's output."""
    state = tmp_path / "state"
    scheduler = await support.start_in_process(
        nats_server.url, namespace, "scheduler", scheduler_app.setup, state_dir=state
    )
    pool = await support.start_in_process(
        nats_server.url, namespace, "pool-manager", pool_app.make_setup(RUNTIME), state_dir=state
    )
    env = support.service_env(nats_server.url, namespace, SBX_STATE_DIR=str(state))
    first = support.spawn_service("executor", env, log_dir / "e1.log")
    nc, topology = await support.connect(nats_server.url, namespace)
    client = Client(nc, topology)
    try:
        await support.wait_for_health(nats_server.url, namespace, "executor")
        await client.sh("k", "mkdir -p /workspace/deep && cd /workspace/deep && export KEPT=yes")
        job = await client.run(
            "k", execution.ShellAsync, command="for i in 1 2 3; do echo tick $i; sleep 0.2; done"
        )
        in_flight = asyncio.create_task(client.run("k", execution.Shell, wait=3, command="sleep 5"))
        await asyncio.sleep(0.5)
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        with pytest.raises(Exception):
            await in_flight
        second = support.spawn_service(
            "executor", {**env, "SBX_INSTANCE_ID": "executor-2"}, log_dir / "e2.log"
        )
        try:
            await support.wait_for_health(nats_server.url, namespace, "executor", "executor-2")
            after = await client.sh("k", 'pwd; echo "$KEPT"')
            assert after.output.splitlines() == ["/workspace/deep", "yes"]
            done = await client.run("k", execution.ShellWait, job_id=job.job_id, timeout=30)
            assert done.status == "exited" and done.output == "tick 1\ntick 2\ntick 3\n"
        finally:
            second.terminate()
            second.wait(15)
    finally:
        if first.poll() is None:
            first.kill()
        await nc.close()
        await pool.stop()
        await scheduler.stop()
        from shared.runtime.local import runtime as local

        rt = local.LocalRuntime(state)
        for info in await rt.list():
            await rt.delete(info.sandbox_id)


async def test_stop_keeps_the_workspace_and_delete_removes_the_sandbox(stack, tmp_path):
    """Stopping a session stops its sandbox; the next call resumes the same sandbox with
    its workspace. Deleting the session deletes the sandbox in the runtime too."""
    await stack.sh("life", "echo kept > /workspace/kept; cd /tmp")
    sandbox = (await stack.ensure("life")).session.sandbox_id
    stopped = await support.send(
        stack.nc, stack.topology, commands.StopSession(command_id=ids.new_id(), session_id="life")
    )
    assert stopped.ok and stopped.session.status == "stopped"
    from shared.runtime.local import runtime as local

    rt = local.LocalRuntime(tmp_path / "state")
    assert (await rt.get(sandbox)).status == "stopped"
    resumed = await stack.sh("life", "cat /workspace/kept; pwd")
    note, _, rest = resumed.output.partition("\n")
    assert rest == "kept\n/tmp\n" and note.startswith("[a new shell: the sandbox was restarted")
    assert (await stack.ensure("life")).session.sandbox_id == sandbox
    deleted = await support.send(
        stack.nc, stack.topology, commands.DeleteSession(command_id=ids.new_id(), session_id="life")
    )
    assert deleted.ok
    assert await rt.get(sandbox) is None
    # The executor remembers the sandbox's owner; the deleted sandbox is refused all the same.
    late = execution.Shell(session_id="life", sandbox_id=sandbox, command="echo too late")
    refused = execution.decode_reply(
        (await stack.nc.request(stack.topology.exec_requests, codec.encode(late), timeout=30)).data
    )
    assert not refused.ok and refused.error.code == "not_found", refused
    tags = [
        s.event.__struct_config__.tag
        for s in await support.stream_events(stack.nc, stack.topology, subjects.SANDBOX)
    ]
    assert tags == [
        "sandbox.requested",
        "sandbox.started",
        "sandbox.stopped",
        "sandbox.started",
        "sandbox.deleted",
    ]


async def test_a_background_process_does_not_hold_the_shell(stack):
    """A server started with `&` must not keep the session's lock: the next call runs."""
    await stack.sh("bg", "sleep 30 > /dev/null 2>&1 &")
    reply = await stack.sh("bg", "echo next", timeout=10)
    assert reply.output == "next\n" and not reply.timed_out


async def test_a_sandbox_that_stopped_behind_our_back_is_started_again(stack, tmp_path):
    from shared.runtime.local import runtime as local

    await stack.sh("revive", "echo kept > /workspace/f")
    sandbox = (await stack.ensure("revive")).session.sandbox_id
    await local.LocalRuntime(tmp_path / "state").stop(sandbox)  # e.g. a host reboot
    request = execution.Shell(session_id="revive", sandbox_id=sandbox, command="true")
    refused = execution.decode_reply(
        (await stack.nc.request(stack.topology.exec_requests, codec.encode(request), timeout=30)).data
    )
    assert not refused.ok and refused.error.code == "not_running"
    again = await stack.ensure("revive")  # what the gateway does after such a refusal
    assert again.session.sandbox_id == sandbox
    text = (await stack.sh("revive", "cat /workspace/f")).output
    assert text.endswith("were kept, the rest of the shell state was not]\nkept\n")


async def test_a_sandbox_showing_an_organisations_cache_never_runs_a_call_of_a_session_of_none(stack):
    """Defence in depth: however a sandbox made for acme (its cache mounted from the
    start) came to be named for a session without an organisation (here: a provision
    request sent straight to the pool-manager), the executor refuses that session's calls
    in it, so the cache never reaches a session any key may use."""
    sandbox_id = "sb-" + ids.new_id()[:20]
    provision = provisioning.Provision(
        command_id=ids.new_id(), sandbox_id=sandbox_id, session_id="mixed", org_id="acme"
    )
    raw = await stack.nc.request(stack.topology.pool_requests, codec.encode(provision), timeout=60)
    assert provisioning.decode_reply(raw.data).ok
    created = await support.send(
        stack.nc, stack.topology, commands.CreateSession(command_id=ids.new_id(), session_id="mixed")
    )
    assert created.ok and created.session.org_id is None
    call = execution.Shell(session_id="mixed", sandbox_id=sandbox_id, command="ls -A /.sbx/cache")
    reply = execution.decode_reply(
        (await stack.nc.request(stack.topology.exec_requests, codec.encode(call), timeout=30)).data
    )
    assert not reply.ok and reply.error.code == "conflict" and "another organisation" in reply.error.message


async def test_audit_fails_closed_when_the_event_store_refuses_records(stack):
    """A full event stream (max messages reached, new ones discarded: what a full disk
    looks like to JetStream) refuses the audit record of a command: the call is reported
    as an error saying the command ran, never as a success nobody can audit; from then
    on, no command runs until a record of its start can be written."""
    await stack.sh("audit", "true")
    js = stack.nc.jetstream()
    name = stack.topology.events_stream
    info = await js.stream_info(name)
    config = info.config
    full = msgspec_replace(config, max_msgs=info.state.messages, discard="new")
    await js.update_stream(full)
    try:
        reply = await stack.run("audit", execution.Shell, command="echo ran > /workspace/proof")
        assert not reply.ok and "audit record could not be written" in reply.error.message, reply
        assert "it ran (exit code 0)" in reply.error.message
        reply = await stack.run("audit", execution.Shell, command="echo ran > /workspace/unrecorded")
        assert not reply.ok and "not run" in reply.error.message, reply
    finally:
        await js.update_stream(config)
    proof = await stack.sh("audit", "cat /workspace/proof; ls /workspace")
    assert "ran" in proof.output and "unrecorded" not in proof.output
    events = await support.stream_events(stack.nc, stack.topology, subjects.EXEC)
    outcomes = [s.event.outcome for s in events if s.event.session_id == "audit"]
    assert outcomes[-2:] == ["started", "ok"], outcomes  # the first call after: its start, then its end


def msgspec_replace(config, **changes):
    from dataclasses import replace

    from nats.js.api import DiscardPolicy

    if "discard" in changes:
        changes["discard"] = DiscardPolicy(changes["discard"])
    return replace(config, **changes)


async def test_a_helper_flooding_the_executor_is_cut_off_at_its_cap(stack):
    """The executor's helper scripts run the sandbox's own tools, which root inside can
    replace: a fake ``tail`` printing 120 MB to one shell_poll is killed at the cap (the
    executor never holds it) and the call says so; the executor goes on serving."""
    job_reply = await stack.run("flood", execution.ShellAsync, command="echo hello")
    assert job_reply.ok, job_reply.error
    fake = "printf '#!/bin/sh\\nhead -c 120000000 /dev/zero\\n' > /usr/local/bin/tail"
    await stack.sh("flood", f"{fake} && chmod +x /usr/local/bin/tail")
    reply = await stack.run("flood", execution.ShellPoll, job_id=job_reply.job_id)
    assert not reply.ok and "wrote more than" in reply.error.message, reply
    assert reply.error.code == "limit_exceeded"
    await stack.sh("flood", "rm /usr/local/bin/tail")
    reply = await stack.run("flood", execution.ShellPoll, job_id=job_reply.job_id)
    assert reply.ok and "hello" in reply.output, reply
