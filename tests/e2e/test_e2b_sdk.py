"""The E2B SDK (PyPI ``e2b``, unmodified) against a real `sbx up`: its control plane and,
of the in-sandbox API, foreground commands and the health check (docs/e2b.md). The SDK
is pointed at the stack with E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY, and any route
to E2B's cloud is dead (E2B_DOMAIN names a host that does not resolve, the proxy
variables a closed port). Every call is a session command: the session's timeline holds
what the SDK asked for."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest

from tests.e2e.stacks import running_stack, sbx

if sdk_dir := os.environ.get("SBX_E2B_SDK_DIR"):  # scripts/e2b-newest: another SDK, first
    sys.path.insert(0, sdk_dir)
e2b = pytest.importorskip("e2b")
if (wanted := os.environ.get("SBX_E2B_SDK_VERSION")) and importlib.metadata.version("e2b") != wanted:
    raise RuntimeError(f"e2b {wanted} was asked for, {importlib.metadata.version('e2b')} is imported")

pytestmark = [
    pytest.mark.needs_root("the local runtime"),
    pytest.mark.slow,
    pytest.mark.timeout(300),
]
OLD_SDK = Path(__file__).parents[2] / ".venv-e2b-old" / "bin" / "python"
"""The environment `scripts/setup --dev` makes with the E2B SDK before 2.51."""
ORG_KEYS = {"acme": "acme-key-e2b-0123456789", "globex": "globex-key-e2b-012345678"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    state = tmp_path_factory.mktemp("e2b") / "state"
    keys = state.parent / "org-keys"
    keys.write_text("".join(f"{org} {key}\n" for org, key in ORG_KEYS.items()))
    with running_stack(state, SBX_ORG_KEYS=str(keys), SBX_REAPER_INTERVAL="0.5") as (_, url):
        yield state, url, (state / "api-key").read_text().strip()


@pytest.fixture
def sdk_env(stack, monkeypatch):
    state, url, key = stack
    monkeypatch.setenv("E2B_API_URL", f"{url}/e2b")
    monkeypatch.setenv("E2B_SANDBOX_URL", f"{url}/e2b/envd")
    monkeypatch.setenv("E2B_API_KEY", ORG_KEYS["acme"])
    monkeypatch.setenv("E2B_DOMAIN", "e2b-cloud.invalid")
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    return state, url, key


def timeline(state, session_id: str) -> list[dict]:
    out = sbx("events", "--json", "--session", session_id, state=state)
    assert out.returncode == 0, out.stderr
    return [json.loads(line)["event"] for line in out.stdout.splitlines()]


def test_lifecycle_through_the_sync_sdk(sdk_env):
    state, url, _ = sdk_env
    from e2b import Sandbox, SandboxQuery, SandboxState

    sandbox = Sandbox.create(timeout=120, metadata={"suite": "e2b", "run": "1"}, envs={"GREETING": "hi"})
    sid = sandbox.sandbox_id
    info = sandbox.get_info()
    assert info.sandbox_id == sid and info.state == SandboxState.RUNNING
    assert info.metadata == {"suite": "e2b", "run": "1"}
    assert info.sandbox_domain == "127.0.0.1"  # ours, never E2B's
    assert sandbox.is_running is not None

    def listed(**query) -> list[str]:
        paginator = Sandbox.list(query=SandboxQuery(**query), limit=1)
        found: list[str] = []
        while paginator.has_next:
            found += [s.sandbox_id for s in paginator.next_items()]
        return found

    other = Sandbox.create(metadata={"suite": "e2b", "run": "2"})
    assert set(listed(metadata={"suite": "e2b"})) == {sid, other.sandbox_id}  # a page each
    assert listed(metadata={"run": "2"}) == [other.sandbox_id]
    assert listed(metadata={"run": "3"}) == []

    sandbox.set_timeout(600)
    assert sandbox.pause() is True
    assert Sandbox.pause(sid) is False  # already paused: E2B's 409
    assert listed(state=[SandboxState.PAUSED], metadata={"suite": "e2b"}) == [sid]
    again = Sandbox.connect(sid, timeout=900)
    assert again.sandbox_id == sid and again.get_info().state == SandboxState.RUNNING

    snapshot = again.create_snapshot()
    assert snapshot.snapshot_id in [
        s.snapshot_id for s in Sandbox.list_snapshots(sandbox_id=sid).next_items()
    ]
    restored = Sandbox.create(template=snapshot.snapshot_id, metadata={"from": "snapshot"})
    assert restored.get_info().metadata == {"from": "snapshot"}
    forks = again.fork(count=2)
    assert len(forks) == 2 and len({f.sandbox_id for f in forks}) == 2
    assert forks[0].get_info().metadata == {"suite": "e2b", "run": "1"}  # a fork keeps the labels

    assert again.is_running() is True  # envd's /health
    result = again.commands.run("echo out $GREETING; echo err >&2", envs={"EXTRA": "x"})
    assert (result.stdout, result.stderr, result.exit_code) == ("out hi\n", "err\n", 0)
    assert again.commands.run("echo $EXTRA-$PWD", cwd="/tmp", envs={"EXTRA": "x"}).stdout == "x-/tmp\n"
    with pytest.raises(e2b.CommandExitException) as failed:
        again.commands.run("echo partial; exit 3")
    assert failed.value.exit_code == 3 and failed.value.stdout == "partial\n"
    token = again._envd_access_token
    route = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983"}
    assert httpx.get(f"{url}/e2b/envd/health", headers={**route, "X-Access-Token": token}).status_code == 204
    for wrong in ({}, {"X-Access-Token": "0" * 64}, {"X-Access-Token": other._envd_access_token}):
        refused = httpx.get(f"{url}/e2b/envd/health", headers={**route, **wrong})
        assert refused.status_code == 401 and refused.json()["code"] == "unauthenticated", refused.text
    other_port = {**route, "E2b-Sandbox-Port": "8080", "X-Access-Token": token}
    assert httpx.get(f"{url}/e2b/envd/health", headers=other_port).status_code == 501
    with pytest.raises(Exception, match="PTY sessions are not served by this stack"):
        again.pty.create(e2b.PtySize(rows=24, cols=80))
    sleeper = again.commands.run("sleep 60", background=True)
    with pytest.raises(e2b.SandboxException, match=f"process {sleeper.pid} has no PTY to resize"):
        again.pty.resize(sleeper.pid, e2b.PtySize(rows=30, cols=100))  # process.Process/Update
    with pytest.raises(e2b.SandboxException, match="no running process"):
        again.pty.resize(999_999, e2b.PtySize(rows=30, cols=100))
    sleeper.kill()

    for made in (sandbox, other, restored, *forks):
        assert made.kill() is True
    assert Sandbox.kill(sid) is False  # gone: E2B's 404
    with pytest.raises(e2b.NotFoundException):
        Sandbox.connect(sid)
    assert Sandbox.delete_snapshot(snapshot.snapshot_id) is True
    assert Sandbox.delete_snapshot(snapshot.snapshot_id) is False

    history = [e for e in timeline(state, sid) if e["type"].startswith("session.")]
    kinds = [e["type"] for e in history]
    assert (
        kinds[0] == "session.created" and "session.deadline_set" in kinds and kinds[-1] == "session.deleted"
    )
    created = history[0]
    assert created["metadata"] == {"suite": "e2b", "run": "1"} and created["env"] == {"GREETING": "hi"}
    assert created["meta"]["org_id"] == "acme" and created["end_at"]


def test_metrics_through_the_sdk(sdk_env):
    """One reading taken now by the runtime (the sandbox's cgroup and filesystem): CPU of a
    busy loop, a file written, a paused sandbox read without resuming it; a range that
    ended earlier has none (no history is kept)."""
    state, url, _ = sdk_env
    from e2b import Sandbox, SandboxState

    sandbox = Sandbox.create(timeout=300)
    (idle,) = sandbox.get_metrics()
    assert idle.cpu_count >= 1 and 0 < idle.mem_used <= idle.mem_total and idle.mem_cache <= idle.mem_used
    assert 0 < idle.disk_used < idle.disk_total
    assert abs((idle.timestamp - datetime.now(UTC)).total_seconds()) < 60
    sandbox.commands.run("dd if=/dev/zero of=/workspace/blob bs=1M count=32 conv=fsync 2>/dev/null")
    sandbox.commands.run("while :; do :; done", background=True)
    (busy,) = Sandbox.get_metrics(sandbox.sandbox_id)
    assert busy.cpu_used_pct > 0 and busy.disk_used - idle.disk_used >= 32 * 1024**2
    assert Sandbox.get_metrics(sandbox.sandbox_id, end=datetime.now(UTC) - timedelta(hours=1)) == []

    assert sandbox.pause() is True
    (paused,) = sandbox.get_metrics()
    assert paused.cpu_used_pct == 0 and paused.mem_used > 0
    assert sandbox.get_info().state == SandboxState.PAUSED  # read, not resumed
    ask = {"X-API-KEY": ORG_KEYS["acme"]}
    for bad in ({"start": "soon"}, {"end": "-5"}):
        answer = httpx.get(f"{url}/e2b/sandboxes/{sandbox.sandbox_id}/metrics", headers=ask, params=bad)
        assert answer.status_code == 400 and set(answer.json()) == {"code", "message"}
    assert sandbox.kill() is True
    with pytest.raises(e2b.NotFoundException):
        Sandbox.get_metrics(sandbox.sandbox_id)
    assert not [e for e in timeline(state, sandbox.sandbox_id) if e.get("tool") == "usage"]  # a read


def test_watching_a_directory_through_the_sync_sdk(sdk_env):
    """The sync SDK's watch_dir is the polling watcher: the changes since the last poll,
    kept in the sandbox between polls."""
    from e2b import FilesystemEventType as Kind
    from e2b import Sandbox

    sandbox = Sandbox.create()
    files = sandbox.files
    files.make_dir("watched/sub")
    files.write("watched/old", "o")
    files.write("watched/kept", "k")
    handle = files.watch_dir("watched", recursive=True)
    files.write("watched/sub/new.txt", "n")
    files.write("watched/kept", "more")
    files.rename("watched/old", "watched/renamed")
    sandbox.commands.run("chmod 600 /workspace/watched/kept")

    def seen(events) -> set[tuple[str, Kind]]:
        return {(e.name, e.type) for e in events}

    assert seen(handle.get_new_events()) == {
        ("sub/new.txt", Kind.CREATE),
        ("kept", Kind.WRITE),
        ("kept", Kind.CHMOD),
        ("old", Kind.RENAME),
        ("renamed", Kind.CREATE),
    }
    assert handle.get_new_events() == []  # only what changed since the last poll
    files.remove("watched/renamed")
    assert seen(handle.get_new_events()) == {("renamed", Kind.REMOVE)}
    flat = files.watch_dir("watched")  # not recursive: the directory's own entries
    files.write("watched/sub/deeper", "d")
    files.write("watched/top", "t")
    assert seen(flat.get_new_events()) == {("top", Kind.CREATE)}
    handle.stop()
    flat.stop()
    with pytest.raises(e2b.SandboxException, match="already stopped"):
        handle.get_new_events()
    with pytest.raises(e2b.NotFoundException):
        files.watch_dir("no-such-dir")
    assert sandbox.kill() is True


async def test_watching_a_directory_through_the_async_sdk(sdk_env):
    """The async SDK's watch_dir is WatchDir: events streamed as the sandbox sees them,
    until the handle stops (the process in the sandbox ends with the stream)."""
    import asyncio

    from e2b import AsyncSandbox
    from e2b import FilesystemEventType as Kind

    sandbox = await AsyncSandbox.create()
    await sandbox.files.make_dir("/tmp/w")
    events: list[tuple[str, Kind]] = []
    got = asyncio.Event()

    def on_event(event) -> None:
        events.append((event.name, event.type))
        if ("d/b", Kind.REMOVE) in events:
            got.set()

    handle = await sandbox.files.watch_dir("/tmp/w", on_event, recursive=True)
    await sandbox.files.write("/tmp/w/a", "1")
    await sandbox.commands.run("mkdir /tmp/w/d && echo 2 > /tmp/w/d/b")
    await sandbox.commands.run("sleep 1; rm /tmp/w/d/b")
    await asyncio.wait_for(got.wait(), 60)
    # (a listing taken between a file's creation and its first bytes adds a write: not asserted)
    assert [e for e in events if e[1] != Kind.WRITE] == [
        ("a", Kind.CREATE),
        ("d", Kind.CREATE),
        ("d/b", Kind.CREATE),
        ("d/b", Kind.REMOVE),
    ]
    await handle.stop()
    watchers = await sandbox.commands.run("ps -eo args | grep -c '[f]ind /tmp/w' || true")
    assert watchers.stdout.strip() == "0"
    with pytest.raises(e2b.NotFoundException):
        await sandbox.files.watch_dir("/tmp/none", on_event)
    await sandbox.kill()


def test_files_through_the_sync_sdk(sdk_env):
    state, url, _ = sdk_env
    from e2b import FileType, Sandbox
    from e2b.sandbox.filesystem.filesystem import WriteEntry

    sandbox = Sandbox.create()
    files = sandbox.files
    assert files.write("/tmp/e2b/a.txt", "héllo\n").path == "/tmp/e2b/a.txt"  # parents made
    assert files.read("/tmp/e2b/a.txt") == "héllo\n"
    blob = bytes(range(256)) * 4096  # 1 MiB, every byte value
    files.write("/tmp/e2b/blob.bin", blob)
    assert bytes(files.read("/tmp/e2b/blob.bin", format="bytes")) == blob
    assert b"".join(files.read("/tmp/e2b/blob.bin", format="stream")) == blob
    written = files.write_files(
        [WriteEntry(path="many/one.txt", data="1"), WriteEntry(path="/tmp/e2b/two.txt", data=b"2")]
    )
    assert [w.path for w in written] == [
        "/workspace/many/one.txt",
        "/tmp/e2b/two.txt",
    ]  # relative: /workspace
    assert sandbox.commands.run("cat /workspace/many/one.txt /tmp/e2b/two.txt").stdout == "12"

    assert files.exists("/tmp/e2b/a.txt") and not files.exists("/tmp/e2b/none")
    info = files.get_info("/tmp/e2b/a.txt")
    assert (info.name, info.type, info.size, info.path) == ("a.txt", FileType.FILE, 7, "/tmp/e2b/a.txt")
    assert info.permissions == "-rw-r--r--" and info.owner
    assert files.get_info("/tmp/e2b").type == FileType.DIR
    with pytest.raises(e2b.FileNotFoundException):
        files.get_info("/tmp/e2b/none")
    with pytest.raises(e2b.FileNotFoundException):
        files.read("/tmp/e2b/none")

    assert files.make_dir("/tmp/e2b/sub/deeper") is True
    assert files.make_dir("/tmp/e2b/sub/deeper") is False  # there already
    sandbox.commands.run("ln -s /tmp/e2b/a.txt /tmp/e2b/link")
    top = {e.name: e for e in files.list("/tmp/e2b")}
    assert set(top) == {"a.txt", "blob.bin", "two.txt", "sub", "link"}
    assert top["sub"].type == FileType.DIR and top["link"].symlink_target == "/tmp/e2b/a.txt"
    deep = {e.path for e in files.list("/tmp/e2b", depth=3)}
    assert {"/tmp/e2b/sub", "/tmp/e2b/sub/deeper"} <= deep

    moved = files.rename("/tmp/e2b/a.txt", "/tmp/e2b/sub/b.txt")
    assert (moved.path, moved.type) == ("/tmp/e2b/sub/b.txt", FileType.FILE)
    assert not files.exists("/tmp/e2b/a.txt") and files.read("/tmp/e2b/sub/b.txt") == "héllo\n"
    with pytest.raises(e2b.FileNotFoundException):
        files.rename("/tmp/e2b/a.txt", "/tmp/e2b/c.txt")
    files.remove("/tmp/e2b/sub")
    assert not files.exists("/tmp/e2b/sub/b.txt")
    with pytest.raises(e2b.FileNotFoundException):
        files.remove("/tmp/e2b/sub")
    with pytest.raises(e2b.InvalidArgumentException):
        files.list("/tmp/e2b/two.txt")  # not a directory

    audited = [e for e in timeline(state, sandbox.sandbox_id) if e["type"] == "exec.completed"]
    tools = {e["tool"] for e in audited}
    assert {"files", "read_file", "write_file"} <= tools
    assert {"move /tmp/e2b/a.txt to /tmp/e2b/sub/b.txt", "write /tmp/e2b/a.txt"} <= {
        e["command"] for e in audited
    }
    assert sandbox.kill() is True


async def test_files_through_the_async_sdk_and_plain_http(sdk_env):
    _, url, _ = sdk_env
    import gzip

    from e2b import AsyncSandbox

    sandbox = await AsyncSandbox.create()
    await sandbox.files.write("notes/a.txt", "async\n")
    assert await sandbox.files.read("/workspace/notes/a.txt") == "async\n"
    assert [e.name for e in await sandbox.files.list("notes")] == ["a.txt"]
    assert await sandbox.files.make_dir("notes/sub") is True
    await sandbox.files.rename("notes/a.txt", "notes/sub/a.txt")
    assert (await sandbox.files.get_info("notes/sub/a.txt")).size == 6
    await sandbox.files.remove("notes")
    assert not await sandbox.files.exists("notes")

    route = {
        "E2b-Sandbox-Id": sandbox.sandbox_id,
        "E2b-Sandbox-Port": "49983",
        "X-Access-Token": sandbox._envd_access_token,
    }
    async with httpx.AsyncClient(base_url=f"{url}/e2b/envd", headers=route, timeout=60) as envd:
        octets = {"Content-Type": "application/octet-stream"}
        answer = await envd.post("/files", params={"path": "/tmp/raw.bin"}, content=b"\0raw", headers=octets)
        assert answer.status_code == 200 and answer.json() == [
            {"name": "raw.bin", "type": "file", "path": "/tmp/raw.bin"}
        ]
        zipped = {**octets, "Content-Encoding": "gzip"}
        body = gzip.compress(b"z" * 3_000_000)
        answer = await envd.post("/files", params={"path": "/tmp/z"}, content=body, headers=zipped)
        assert answer.status_code == 200, answer.text
        assert (await envd.get("/files", params={"path": "/tmp/raw.bin"})).content == b"\0raw"
        assert (await envd.get("/files", params={"path": "/tmp/z"})).content == b"z" * 3_000_000
        missing = await envd.get("/files", params={"path": "/tmp/none"})
        assert missing.status_code == 404 and missing.json()["code"] == 404
        directory = await envd.get("/files", params={"path": "/tmp"})
        assert directory.status_code == 400
        bad = await envd.post("/files", params={"path": "/tmp/x"}, content=b"not gzip", headers=zipped)
        assert bad.status_code == 400 and "gzip" in bad.json()["message"]
        stranger = {**route, "X-Access-Token": "0" * 64}
        assert (await envd.get("/files", params={"path": "/tmp/z"}, headers=stranger)).status_code == 401
    assert await sandbox.kill() is True


def test_background_processes_through_the_sync_sdk(sdk_env):
    state, _, _ = sdk_env
    from e2b import Sandbox

    sandbox = Sandbox.create(envs={"WHO": "session"})
    commands = sandbox.commands
    # A background command outlives its stream: dropped, listed, re-attached, killed.
    sleeper = commands.run("echo started; sleep 600", background=True, cwd="/tmp", envs={"MARK": "s1"})
    assert sleeper.pid > 0
    listed = {p.pid: p for p in commands.list()}
    assert listed[sleeper.pid].args == ["-l", "-c", "echo started; sleep 600"]
    assert (listed[sleeper.pid].cwd, listed[sleeper.pid].envs) == ("/tmp", {"MARK": "s1"})
    sleeper.disconnect()
    again = commands.connect(sleeper.pid)
    assert again.pid == sleeper.pid
    assert commands.kill(sleeper.pid) is True
    with pytest.raises(e2b.CommandExitException) as killed:
        again.wait()
    assert killed.value.exit_code == -1
    assert sleeper.pid not in {p.pid for p in commands.list()}
    assert commands.kill(sleeper.pid) is False  # gone: envd's not_found
    for not_a_job in (1, os.getpid()):  # the sandbox's init, a host pid: never a job of this session
        assert commands.kill(not_a_job) is False
        with pytest.raises(e2b.SandboxException):
            commands.send_stdin(not_a_job, "x")

    # stdin: sent, then closed; the command sees its end.
    cat = commands.run("cat; echo done-$WHO >&2", background=True, stdin=True)
    commands.send_stdin(cat.pid, "line one\n")
    cat.send_stdin(b"line two\n")
    commands.stream_input(cat.pid, ["stream", "ed\n"])
    commands.close_stdin(cat.pid)
    result = cat.wait()
    assert (result.stdout, result.stderr, result.exit_code) == (
        "line one\nline two\nstreamed\n",
        "done-session\n",
        0,
    )
    with pytest.raises(e2b.SandboxException):
        commands.send_stdin(cat.pid, "late")  # it has ended
    quiet = commands.run("sleep 600", background=True)  # without stdin=True: it reads nothing
    with pytest.raises(e2b.SandboxException):
        commands.send_stdin(quiet.pid, "x")

    # Paused and resumed: the process and the files are still there.
    sandbox.files.write("/tmp/kept", "kept")
    assert sandbox.pause() is True
    resumed = Sandbox.connect(sandbox.sandbox_id)
    assert quiet.pid in [p.pid for p in resumed.commands.list()]
    assert resumed.files.read("/tmp/kept") == "kept"
    assert resumed.commands.kill(quiet.pid) is True

    # Output streamed while it runs; wait gives the exit code.
    seen: list[str] = []
    counter = commands.run("for i in 1 2 3; do echo $i; sleep 0.2; done; exit 4", background=True)
    with pytest.raises(e2b.CommandExitException) as failed:
        counter.wait(on_stdout=seen.append)
    assert failed.value.exit_code == 4 and "".join(seen) == "1\n2\n3\n"
    assert commands.run("echo fg").stdout == "fg\n"  # foreground: the same path

    audited = [e for e in timeline(state, sandbox.sandbox_id) if e["type"] == "exec.completed"]
    tools = {e["tool"] for e in audited}
    assert {"shell_async", "shell_signal", "shell_input"} <= tools
    assert any(e["command"].startswith("signal KILL ") for e in audited)
    assert sandbox.kill() is True


async def test_background_processes_through_the_async_sdk(sdk_env):
    from e2b import AsyncSandbox

    sandbox = await AsyncSandbox.create()
    handle = await sandbox.commands.run("read x; echo got-$x", background=True, stdin=True)
    assert handle.pid in [p.pid for p in await sandbox.commands.list()]
    await sandbox.commands.send_stdin(handle.pid, "it\n")
    result = await handle.wait()
    assert result.stdout == "got-it\n"
    slow = await sandbox.commands.run("sleep 600", background=True)
    again = await sandbox.commands.connect(slow.pid)
    assert await again.kill() is True
    with pytest.raises(e2b.CommandExitException):
        await again.wait()
    assert await sandbox.kill() is True


def test_keys_and_organisations(sdk_env):
    from e2b import Sandbox

    mine = Sandbox.create(metadata={"who": "acme"})
    with pytest.raises(e2b.AuthenticationException):
        Sandbox.create(api_key="not-a-key-of-this-stack")
    theirs = Sandbox.create(metadata={"who": "globex"}, api_key=ORG_KEYS["globex"])
    seen = [s.sandbox_id for s in Sandbox.list().next_items()]
    assert mine.sandbox_id in seen and theirs.sandbox_id not in seen
    with pytest.raises(e2b.SandboxException):  # another organisation's: as a missing one
        Sandbox.get_info(theirs.sandbox_id)
    assert Sandbox.kill(theirs.sandbox_id) is False
    assert Sandbox.kill(theirs.sandbox_id, api_key=ORG_KEYS["globex"]) is True
    assert mine.kill() is True


async def test_the_async_sdk(sdk_env):
    from e2b import AsyncSandbox

    sandbox = await AsyncSandbox.create(metadata={"client": "async"}, idempotency_key="async-1")
    same = await AsyncSandbox.create(metadata={"client": "async"}, idempotency_key="async-1")
    assert same.sandbox_id == sandbox.sandbox_id  # the same key: the same sandbox
    info = await sandbox.get_info()
    assert info.metadata == {"client": "async"}
    await sandbox.set_timeout(300)
    assert await sandbox.pause() is True
    resumed = await AsyncSandbox.connect(sandbox.sandbox_id)
    assert (await resumed.get_info()).state.value == "running"
    assert await resumed.kill() is True


def test_the_sdk_before_2_51(sdk_env):
    """The SDK that creates with POST /sandboxes and connects with /sandboxes/{id}/connect."""
    assert OLD_SDK.exists(), "run scripts/setup --dev: it makes .venv-e2b-old with e2b 2.50"
    out = subprocess.run(
        [str(OLD_SDK), str(Path(__file__).with_name("e2b_old_sdk_checks.py"))],
        capture_output=True, text=True, timeout=240, env=dict(os.environ),
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.split() == [
        "sdk",
        "2.50.0",
        "create",
        "list",
        "pause",
        "and",
        "connect",
        "run",
        "background",
        "files",
        "kill",
        "async",
    ]


def test_a_timeout_deletes_the_sandbox(sdk_env):
    state, _, _ = sdk_env
    from e2b import Sandbox

    sandbox = Sandbox.create(timeout=2)
    give_up = time.monotonic() + 60
    while sandbox.sandbox_id in [s.sandbox_id for s in Sandbox.list().next_items()]:
        assert time.monotonic() < give_up, "the reaper did not delete the sandbox at its deadline"
        time.sleep(0.2)
    deleted = [e for e in timeline(state, sandbox.sandbox_id) if e["type"] == "session.deleted"]
    assert [e["reason"] for e in deleted] == [
        "deadline"
    ]  # (decided by the reaper, appended by the scheduler)


def test_every_route_checks_the_key_and_the_organisation(sdk_env):
    _, url, operator = sdk_env
    from e2b import Sandbox

    theirs = Sandbox.create(metadata={"who": "globex"}, api_key=ORG_KEYS["globex"])
    sid = theirs.sandbox_id
    acme = {"X-API-KEY": ORG_KEYS["acme"]}
    with httpx.Client(base_url=f"{url}/e2b", timeout=60) as api:
        for headers in (
            {},
            {"Authorization": f"Bearer {ORG_KEYS['acme']}"},  # E2B's header only
            {"X-API-KEY": "wrong"},
        ):
            refused = api.get("/v2/sandboxes", headers=headers)
            assert refused.status_code == 401 and refused.json()["code"] == 401, refused.text
        twice = api.get("/v2/sandboxes", headers=[("X-API-KEY", ORG_KEYS["acme"])] * 2)
        assert twice.status_code == 401
        calls = [
            ("GET", f"/sandboxes/{sid}", None),
            ("POST", f"/v2/sandboxes/{sid}/connect", {}),
            ("POST", f"/sandboxes/{sid}/connect", {}),
            ("POST", f"/sandboxes/{sid}/timeout", {"timeout": 60}),
            ("POST", f"/sandboxes/{sid}/pause", {}),
            ("POST", f"/sandboxes/{sid}/snapshots", {}),
            ("POST", f"/sandboxes/{sid}/fork", {"count": 1}),
            ("GET", f"/sandboxes/{sid}/metrics", None),
            ("DELETE", f"/sandboxes/{sid}", None),
        ]
        for method, path, body in calls:  # another organisation's: as a missing one, nothing done
            answer = api.request(method, path, headers={**acme, "X-Org-Id": "globex"}, json=body)
            assert answer.status_code == 404, (method, path, answer.text)
            assert set(answer.json()) == {"code", "message"} and answer.json()["code"] == 404
        assert [s["sandboxID"] for s in api.get("/v2/sandboxes", headers=acme).json()] == [
            s.sandbox_id for s in Sandbox.list().next_items()
        ]
        assert sid not in [s["sandboxID"] for s in api.get("/v2/sandboxes", headers=acme).json()]
        assert sid in [
            s["sandboxID"] for s in api.get("/v2/sandboxes", headers={"X-API-KEY": operator}).json()
        ]
        bad = api.post("/v2/sandboxes", headers=acme, json={"templateID": "base", "timeout": 0})
        assert bad.status_code == 400 and "timeout" in bad.json()["message"]
        bad = api.post("/v2/sandboxes", headers=acme, json={"templateID": "base", "envVars": {"A=B": "1"}})
        assert bad.status_code == 400 and "shell name" in bad.json()["message"]
        assert api.get("/v2/sandboxes", headers=acme, params={"nextToken": "forged"}).status_code == 400
    assert theirs.get_info().state.value == "running"  # untouched by all of that
    assert theirs.kill() is True
