"""The `sbx` console script as an operator runs it, against a real NATS: every report's
``--json`` has the shape docs/cli.md shows, the exit codes are the documented ones, a
closed pipe and Ctrl-C end it without a traceback, progress bars appear only on a
terminal, and no help text shows a type for a flag."""

from __future__ import annotations

import asyncio
import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest
import typer.main

from sbx import cli, exits, stack
from sbx_client import cli as client_cli
from shared.contract import events, ids, subjects
from shared.infrastructure import eventstore
from tests import oci_registry as o
from tests import support

SBX = str(Path(sys.executable).with_name("sbx"))
DOCS = (support.ROOT / "docs" / "cli.md").read_text()


def environment(nats_url: str | None, namespace: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SBX_", "NATS_"))}
    if nats_url is not None and namespace is not None:
        env |= {"NATS_URL": nats_url, "SBX_NAMESPACE": namespace}
    return env


def sbx(*args: str, env: dict[str, str], **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [SBX, *args], env=env, capture_output=True, text=True, timeout=60, cwd=support.ROOT, **kw
    )


def documented(command: str) -> dict:
    """The JSON example under ``### `sbx COMMAND``` in docs/cli.md (the first line, for NDJSON)."""
    section = DOCS.split(f"### `sbx {command}`", 1)[1].split("\n### ", 1)[0]
    block = re.search(r"```json\n(.*?)```", section, re.DOTALL)
    assert block is not None, f"docs/cli.md shows no JSON for sbx {command}"
    text = block.group(1)
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return json.loads(text.splitlines()[0])


def same_fields(actual: dict, command: str) -> None:
    example = documented(command)
    assert set(actual) == set(example), (command, sorted(actual), sorted(example))


def no_traceback(result: subprocess.CompletedProcess[str] | str) -> None:
    text = result if isinstance(result, str) else result.stderr
    assert "Traceback" not in text and "Exception ignored" not in text, text


async def seed(bus, count: int) -> None:
    """``count`` sessions created, one event each."""
    nc, topology = bus
    store = eventstore.EventStore(nc.jetstream(), topology)

    async def one(n: int) -> None:
        meta = events.Meta(event_id=ids.new_id(), time=datetime.now(UTC), service="test", instance="t")
        created = events.SessionCreated(meta=meta, session_id=f"cli-{n}")
        await store.append(
            topology.aggregate_subject(subjects.SESSION, f"cli-{n}"), [created], expected_last_seq=0
        )

    for start in range(0, count, 200):
        await asyncio.gather(*(one(n) for n in range(start, min(count, start + 200))))


@pytest.fixture
async def stack_env(nats_server, namespace, bus) -> dict[str, str]:
    await seed(bus, 3)
    return environment(nats_server.url, namespace)


# ---- --json ----------------------------------------------------------------------


async def test_reports_of_a_stack_as_json(stack_env):
    status = await asyncio.to_thread(sbx, "status", "--json", env=stack_env)
    assert status.returncode == exits.FAILURE, status.stderr  # no service runs here
    report = json.loads(status.stdout)
    same_fields(report, "status")
    assert report["services"] == [] and len(report["missing"]) == len(stack.SERVICES), report

    replay = await asyncio.to_thread(sbx, "replay", "--json", env=stack_env)
    same_fields(json.loads(replay.stdout), "replay")
    assert json.loads(replay.stdout)["events"] == 3

    replicas = await asyncio.to_thread(sbx, "replicas", "1", "--json", env=stack_env)
    assert replicas.returncode == 0, replicas.stderr
    same_fields(json.loads(replicas.stdout), "replicas")
    for result in (status, replay, replicas):
        no_traceback(result)


async def test_events_are_ndjson_also_when_followed(stack_env, bus):
    listed = await asyncio.to_thread(sbx, "events", "--json", env=stack_env)
    assert listed.returncode == 0, listed.stderr
    lines = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [line["seq"] for line in lines] == [1, 2, 3]
    for line in lines:
        same_fields(line, "events")
        assert line["event"]["type"] == "session.created"

    follow = subprocess.Popen(
        [SBX, "events", "--follow", "--json", "--since", "3"],
        env=stack_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert json.loads(await asyncio.to_thread(follow.stdout.readline))["seq"] == 3
        await seed_more(bus)
        assert json.loads(await asyncio.to_thread(follow.stdout.readline))["seq"] == 4
        follow.send_signal(signal.SIGINT)  # Ctrl-C
        _, err = await asyncio.to_thread(follow.communicate, timeout=30)
    finally:
        if follow.poll() is None:
            follow.kill()
    assert follow.returncode == exits.INTERRUPTED, err
    no_traceback(err)


async def seed_more(bus) -> None:
    nc, topology = bus
    store = eventstore.EventStore(nc.jetstream(), topology)
    meta = events.Meta(event_id=ids.new_id(), time=datetime.now(UTC), service="test", instance="t")
    subject = topology.aggregate_subject(subjects.SESSION, "cli-late")
    await store.append(
        subject, [events.SessionCreated(meta=meta, session_id="cli-late")], expected_last_seq=0
    )


def test_local_reports_as_json(tmp_path):
    """The commands that work on this machine's state dir: images, route, down."""
    env, state = environment(None, None), ["--state-dir", str(tmp_path / "state")]
    rootfs = tmp_path / "rootfs"
    (rootfs / "bin").mkdir(parents=True)
    (rootfs / "bin" / "sh").write_bytes(b"")
    layout = tmp_path / "layout"
    o.write_layout(layout, [(o.image_manifest(layout, [o.layer({"bin/sh": b"", "etc/os": b"cli"})]), None)])

    reports = {
        "image pull": sbx("image", "pull", "default", "--json", *state, env=env),
        "image add": sbx("image", "add", "rooted", str(rootfs), "--json", *state, env=env),
        "image import": sbx("image", "import", "imported", str(layout), "--json", *state, env=env),
        "image list": sbx("image", "list", "--json", *state, env=env),
        "image prune": sbx("image", "prune", "--json", *state, env=env),
        "route": sbx("route", "--json", "--", "git", "push", "origin", "HEAD", env=env),
        "down": sbx("down", "--json", *state, env=env),
    }
    for command, result in reports.items():
        assert result.returncode == 0, (command, result.stderr)
        no_traceback(result)
        same_fields(json.loads(result.stdout), command)
    listed = json.loads(reports["image list"].stdout)["images"]
    assert [(i["reference"], i["kind"]) for i in listed] == [
        ("default", "built-in"), ("imported", "registered"), ("rooted", "registered"),
    ]  # fmt: skip
    assert json.loads(reports["route"].stdout)["where"] == "host"
    assert json.loads(reports["image pull"].stdout)["pulled"] is False


# ---- exit codes ------------------------------------------------------------------


def test_usage_errors_exit_2(tmp_path):
    env = environment(None, None)
    for args in (
        ["events", "--bogus"],
        ["replicas", "9"],
        ["replay", "--verify", "--rebuild"],
        ["image", "prune", "--keep", "12XB", "--state-dir", str(tmp_path)],
        ["image", "pull", "Bad Ref", "--state-dir", str(tmp_path)],
        ["no-such-command"],
        ["status", "--state-dir", str(tmp_path)],  # no stack there: says how to start one
    ):
        result = sbx(*args, env=env)
        assert result.returncode == exits.USAGE, (args, result.stdout, result.stderr)
        assert result.stderr.strip() and not result.stdout, args
        no_traceback(result)


def test_a_nats_that_does_not_answer_is_a_temporary_failure():
    env = environment(f"nats://127.0.0.1:{support.free_port()}", "nobody")
    for args in (["status", "--json"], ["events"]):
        result = sbx(*args, env=env)
        assert result.returncode == exits.TEMPFAIL, (args, result.stderr)
        assert result.stderr.startswith("sbx: error: cannot connect to NATS") and not result.stdout
        no_traceback(result)


def test_ctrl_c_stops_an_image_pull_under_way(tmp_path):
    """The pull's threads stop too: the process does not wait for the rest of a download."""
    registry = o.HostileRegistry()
    state = tmp_path / "state"
    try:
        layer = o.layer({"bin/sh": b"x" * 200_000}, compress=False)
        registry.image("slow", [layer])
        registry.trickle[registry.blob(layer)] = 0.001  # minutes for the whole layer
        named = o.registries_file(tmp_path / "registries.toml", registry.host)
        pull = subprocess.Popen(
            [SBX, "image", "pull", f"{registry.host}/t/img:slow", "--state-dir", str(state)],
            env={**environment(None, None), "SBX_REGISTRIES_FILE": str(named)},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        partial = state / "images" / "blobs"
        asyncio.run(support.eventually(lambda: partial.is_dir() and any(partial.iterdir()), timeout=30))
        pull.send_signal(signal.SIGINT)
        try:
            _, err = pull.communicate(timeout=30)  # (a hang's bound: the download alone takes minutes)
        finally:
            if pull.poll() is None:
                pull.kill()
    finally:
        registry.stop()
    assert pull.returncode == exits.INTERRUPTED, err
    no_traceback(err)
    assert not any(partial.iterdir()), "the partial download is removed"


# ---- pipes -----------------------------------------------------------------------


async def test_a_closed_pipe_ends_the_command_quietly(bus, nats_server, namespace, tmp_path):
    await seed(bus, 2500)  # far more output than a pipe holds: the writer meets the closed pipe
    env = environment(nats_server.url, namespace)
    for command in ("events", "events --json", "replay"):
        script = f"set -o pipefail; {SBX} {command} 2>err | head -1 >first; echo $? >rc"
        await asyncio.to_thread(subprocess.run, ["bash", "-c", script], env=env, cwd=tmp_path, timeout=60)
        assert (tmp_path / "first").read_text().strip(), command
        assert (tmp_path / "err").read_text() == "", command
        assert int((tmp_path / "rc").read_text()) == exits.PIPE_CLOSED, command


@pytest.mark.parametrize(
    "args",
    [
        ["-h"], ["-V"], ["status", "--json"], ["events"], ["replay"], ["replicas", "1"],
        ["image", "list"], ["image", "-h"],
        ["route", "--", "git", "push"],
    ],
    ids=" ".join,
)  # fmt: skip
async def test_output_closed_before_anything_is_written(stack_env, tmp_path, args):
    """Every command that prints, with stdout already closed: 141, nothing on stderr."""
    read, write = os.pipe()
    os.close(read)
    try:
        result = await asyncio.to_thread(
            subprocess.run, [SBX, *args], env={**stack_env, "SBX_STATE_DIR": str(tmp_path)},
            stdout=write, stderr=subprocess.PIPE, text=True, timeout=60,
        )  # fmt: skip
    finally:
        os.close(write)
    assert result.returncode == exits.PIPE_CLOSED, (args, result.stderr)
    assert result.stderr == "", (args, result.stderr)


# ---- progress bars ---------------------------------------------------------------


def on_a_terminal(args: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    """Run with stderr on a pseudo-terminal (stdout a pipe): (exit code, stdout, stderr)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([SBX, *args], env=env, stdout=subprocess.PIPE, stderr=slave, cwd=support.ROOT)
    os.close(slave)
    seen = b""
    while True:
        ready, _, _ = select.select([master], [], [], 60)
        assert ready, "no output and no end within 60 s"
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the terminal's last writer is gone
            break
        if not chunk:
            break
        seen += chunk
    os.close(master)
    out = proc.stdout.read().decode() if proc.stdout else ""
    return proc.wait(30), out, seen.decode(errors="replace")


async def test_progress_bars_only_on_a_terminal_and_never_with_json(stack_env, tmp_path):
    env = {**stack_env, "TERM": "xterm", "COLUMNS": "100"}
    code, out, terminal = await asyncio.to_thread(on_a_terminal, ["replay"], env)
    assert code == exits.FAILURE and "folding events" in terminal and "3/3" in terminal, terminal
    assert "replayed 3 events" in out and "folding" not in out
    code, out, terminal = await asyncio.to_thread(on_a_terminal, ["replay", "--json"], env)
    assert "folding" not in terminal and json.loads(out)["events"] == 3

    layout = tmp_path / "layout"
    o.write_layout(
        layout, [(o.image_manifest(layout, [o.layer({"bin/sh": b""}), o.layer({"a": b"1"})]), None)]
    )
    state = ["--state-dir", str(tmp_path / "state")]
    code, out, terminal = await asyncio.to_thread(
        on_a_terminal, ["image", "import", "x", str(layout), *state], env
    )
    assert code == 0 and "unpacking" in terminal and "2/2" in terminal, terminal
    code, out, terminal = await asyncio.to_thread(
        on_a_terminal, ["image", "import", "y", str(layout), "--json", *state], env
    )
    assert code == 0 and "unpacking" not in terminal and json.loads(out)["name"] == "y"
    no_traceback(terminal)


# ---- help ------------------------------------------------------------------------


def host_client_commands() -> set[str]:
    """The agent-host client's commands, which ``sbx`` registers from sbx_client."""
    return set(typer.main.get_command(client_cli.app).commands)


def command_paths(app: typer.Typer) -> list[list[str]]:
    """Every command and group of ``app``, from the app itself."""
    paths: list[list[str]] = []

    def walk(group, prefix: list[str]) -> None:
        for name, command in group.commands.items():
            paths.append([*prefix, name])
            if hasattr(command, "commands"):
                walk(command, [*prefix, name])

    walk(typer.main.get_command(app), [])
    return paths


def plain_help(path: list[str], env: dict[str, str]) -> None:
    for flag in ("-h", "--help"):
        shown = sbx(*path, flag, env=env)
        assert shown.returncode == 0, (path, shown.stderr)
        assert shown.stdout.startswith(f"Usage: {' '.join(['sbx', *path])} "), (path, shown.stdout)
        assert "<bool>" not in shown.stdout, (path, shown.stdout)  # a flag takes no value
        no_traceback(shown)


def test_help_of_every_command_and_the_version():
    env = environment(None, None)
    for flag in ("--version", "-V"):
        version = sbx(flag, env=env)
        assert version.returncode == 0 and re.fullmatch(r"sbx \S+\n", version.stdout), version
    paths = [p for p in command_paths(cli.app) if p[0] not in host_client_commands()]
    assert {"up", "down", "status", "events", "replay", "replicas", "image"} <= {p[0] for p in paths}
    for path in [[], *paths]:
        plain_help(path, env)
    everything = sbx("-h", env=env).stdout
    for code in (exits.TEMPFAIL, exits.INTERRUPTED, exits.PIPE_CLOSED):
        assert str(code) in everything and f"| {code} |" in DOCS


def test_help_of_the_host_client_commands():
    env = environment(None, None)
    assert host_client_commands() == {"exec", "release", "route"}
    for name in sorted(host_client_commands()):
        plain_help([name], env)
