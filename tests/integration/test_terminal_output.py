"""What ``sbx`` prints of text a sandbox, tenant or registry wrote never reaches the
terminal raw: events carrying ESC[2J, a title-setting OSC, CR/LF-forged lines and U+202E
through ``sbx events``, ``sbx timeline`` and ``sbx events export`` (text and JSON), and an
error naming such text, against a real nats-server."""

from __future__ import annotations

import asyncio
import json
import sys
import unicodedata
from datetime import UTC, datetime
from pathlib import Path

import pytest

from shared.contract import events, ids, subjects
from shared.infrastructure import eventstore
from tests.integration.test_cli import environment

SBX = str(Path(sys.executable).with_name("sbx"))
FORGED = "  999 2026-01-01T00:00:00.000 session.deleted    session_id=victim"
COMMAND = f"make\x1b[2J\x1b]0;owned\x07 all\r{FORGED}\n{FORGED}\x1b[1A\u202etxt.sh\x9b2J\x7f"
REASON = f"manifest unknown\r\n{FORGED}\x1b[31m"


def meta() -> events.Meta:
    return events.Meta(
        event_id=ids.new_id(), time=datetime.now(UTC), service="test", instance="t", user_id="u\x1b[8m"
    )


@pytest.fixture
async def hostile(bus, nats_server, namespace) -> dict[str, str]:
    nc, topology = bus
    store = eventstore.EventStore(nc.jetstream(), topology)
    session = topology.aggregate_subject(subjects.SESSION, "t")
    await store.append(session, [events.SessionCreated(meta=meta(), session_id="t")], expected_last_seq=0)
    exec_subject = topology.aggregate_subject(subjects.EXEC, "t")
    await store.record(
        exec_subject,
        events.CommandExecuted(meta=meta(), session_id="t", sandbox_id="sb", tool="shell", command=COMMAND),
    )
    await store.record(
        exec_subject,
        events.CommandExecuted(
            meta=meta(),
            session_id="t",
            sandbox_id="sb",
            tool="edit",
            command=f"create {COMMAND}",
            path=COMMAND,
        ),
    )
    await store.record(
        topology.aggregate_subject(subjects.IMAGE, "evil"),
        events.ImagePullFailed(meta=meta(), reference="evil\u202e", error="not_found", reason=REASON),
    )
    return environment(nats_server.url, namespace)


def raw_controls(text: str) -> list[str]:
    """Every character a terminal would act on, but the line ends ``sbx`` itself writes."""
    return [c for c in text.replace("\n", "") if unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp")]


def strings(value: object) -> set[str]:
    if isinstance(value, str):
        return {value}
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else []
    return set().union(*(strings(v) for v in items))


async def sbx(env: dict[str, str], *args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        SBX, *args, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode or 0, out.decode(), err.decode()


@pytest.mark.parametrize(
    ("args", "lines"),
    [
        (("events",), 4),
        (("events", "--json"), 4),
        (("events", "--session", "t"), 3),
        (("timeline", "t"), 3),
        (("timeline", "t", "--json"), 3),
        (("events", "export"), 3),
    ],
)
async def test_hostile_text_is_shown_escaped_one_line_per_record(hostile, args, lines):
    code, out, err = await sbx(hostile, *args)
    assert code == 0, err
    assert raw_controls(out) == [] and raw_controls(err) == []
    assert len(out.splitlines()) == lines  # no forged line
    if "--json" in args or "export" in args:
        parsed = [json.loads(line) for line in out.splitlines()]
        assert COMMAND in strings(parsed)  # the value, exactly, for a program
    else:
        assert "\\x1b[2J" in out and "\\u202e" in out and "\\r" in out


async def test_an_error_naming_hostile_text_is_escaped(hostile):
    code, out, err = await sbx(hostile, "timeline", "t\x1b[2J\u202e")
    assert code == 2 and out == ""
    assert err.startswith("sbx: error: ") and len(err.splitlines()) == 1 and raw_controls(err) == []
