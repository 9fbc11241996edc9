"""Wire contract of shared.codec: every event, command, reply and state round-trips and evolves safely."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import msgspec
import pytest

from shared import codec, commands, errors, events, states

T0 = datetime(2025, 3, 14, 15, 9, 26, 535000, tzinfo=UTC)
T1 = datetime(2025, 3, 14, 16, 0, 0, 1, tzinfo=UTC)
SID = "task-42"
ACTOR = commands.Actor(via="mcp", org_id="acme", user_id="alice")


def _meta(**overrides: Any) -> events.Meta:
    fields: dict[str, Any] = dict(
        event_id="0f3c2a9e5b7d4c1f8a6e2d0b9c8a7f61",
        time=T0,
        service="scheduler",
        instance="scheduler-4f2a9c1d7e3b",
        command_id="5d41402abc4b2a76b9719d911017c592",
        correlation_id="req-7c9e6679",
        org_id="acme",
        user_id="alice",
        session_id=SID,
    )
    fields.update(overrides)
    return events.Meta(**fields)


def _session_state(**overrides: Any) -> states.SessionState:
    fields: dict[str, Any] = dict(
        session_id=SID,
        status="stopped",
        image="python:3.12",
        org_id="acme",
        user_id="alice",
        created_at=T0,
        updated_at=T1,
        incarnation=2,
        version=5,
        last_seq=1234,
        last_command_id="5d41402abc4b2a76b9719d911017c592",
    )
    fields.update(overrides)
    return states.SessionState(**fields)


def _instance_state() -> states.InstanceState:
    return states.InstanceState(
        service="scheduler",
        instance="scheduler-4f2a9c1d7e3b",
        status="stopped",
        pid=4242,
        host="node-a",
        version="0.3.1",
        started_at=T0,
        stopped_at=T1,
        last_seq=77,
    )


EVENT_FACTORIES: dict[type, Any] = {
    events.SessionCreated: lambda: events.SessionCreated(
        meta=_meta(), session_id=SID, image="python:3.12", org_id="acme", user_id="alice"
    ),
    events.SessionStopped: lambda: events.SessionStopped(meta=_meta(), session_id=SID, reason="idle"),
    events.SessionDeleted: lambda: events.SessionDeleted(meta=_meta(), session_id=SID, reason="ttl"),
    events.InstanceStarted: lambda: events.InstanceStarted(
        meta=_meta(command_id=None, session_id=None, org_id=None, user_id=None),
        service="scheduler",
        instance="scheduler-4f2a9c1d7e3b",
        pid=4242,
        host="node-a",
        version="0.3.1",
    ),
    events.InstanceStopped: lambda: events.InstanceStopped(
        meta=_meta(command_id=None, session_id=None),
        service="scheduler",
        instance="scheduler-4f2a9c1d7e3b",
        reason="drained",
    ),
}

COMMAND_FACTORIES: dict[type, Any] = {
    commands.CreateSession: lambda: commands.CreateSession(
        command_id="cmd-1", correlation_id="req-1", actor=ACTOR, session_id=SID, image="ghcr.io/org/img:1"
    ),
    commands.StopSession: lambda: commands.StopSession(command_id="cmd-2", actor=ACTOR, session_id=SID),
    commands.DeleteSession: lambda: commands.DeleteSession(
        command_id="cmd-3", correlation_id="req-3", session_id=SID
    ),
}


def test_event_factories_cover_every_event_type() -> None:
    assert set(EVENT_FACTORIES) == set(events.EVENT_TYPES)


def test_command_factories_cover_every_command_type() -> None:
    assert set(COMMAND_FACTORIES) == set(commands.COMMAND_TYPES)


def test_event_tags_are_stable() -> None:
    assert {cls: events.tag_of(cls) for cls in events.EVENT_TYPES} == {
        events.SessionCreated: "session.created",
        events.SessionStopped: "session.stopped",
        events.SessionDeleted: "session.deleted",
        events.InstanceStarted: "instance.started",
        events.InstanceStopped: "instance.stopped",
    }
    assert set(codec.CURRENT_VERSION) == {
        "session.created",
        "session.stopped",
        "session.deleted",
        "instance.started",
        "instance.stopped",
    }


def test_command_tags_are_stable() -> None:
    tags = {cls: cls.__struct_config__.tag for cls in commands.COMMAND_TYPES}
    assert tags == {
        commands.CreateSession: "session.create",
        commands.StopSession: "session.stop",
        commands.DeleteSession: "session.delete",
    }


@pytest.mark.parametrize("cls", events.EVENT_TYPES, ids=events.tag_of)
def test_event_round_trip(cls: type[events.Event]) -> None:
    event = EVENT_FACTORIES[cls]()
    assert type(event) is cls
    data = codec.encode(event)
    raw = json.loads(data)
    assert raw["type"] == events.tag_of(cls)
    assert raw["v"] == events.current_version(cls) == codec.CURRENT_VERSION[raw["type"]]
    decoded = codec.decode_event(data)
    assert type(decoded) is cls
    assert decoded == event
    assert decoded.meta.time == T0 and decoded.meta.time.tzinfo is not None
    assert codec.encode(decoded) == data


@pytest.mark.parametrize("cls", commands.COMMAND_TYPES, ids=lambda c: c.__struct_config__.tag)
def test_command_round_trip(cls: type[commands.Command]) -> None:
    command = COMMAND_FACTORIES[cls]()
    data = codec.encode(command)
    assert json.loads(data)["type"] == cls.__struct_config__.tag
    decoded = codec.decode_command(data)
    assert type(decoded) is cls
    assert decoded == command


@pytest.mark.parametrize(
    "reply",
    [
        commands.CommandReply(ok=True, appended=1, session=_session_state()),
        commands.CommandReply(ok=True, appended=0, session=None),
        commands.CommandReply(
            ok=False, error=commands.ErrorInfo("conflict", "session 'task-42' already exists")
        ),
    ],
    ids=["with-session", "after-delete", "error"],
)
def test_reply_round_trip(reply: commands.CommandReply) -> None:
    assert codec.decode_reply(codec.encode(reply)) == reply


@pytest.mark.parametrize("state", [_session_state(), _instance_state()], ids=["session", "instance"])
def test_state_round_trip(state: msgspec.Struct) -> None:
    decoded = codec.decode_state(codec.encode(state), type(state))
    assert type(decoded) is type(state)
    assert decoded == state


def test_to_builtins_is_json_ready() -> None:
    out = codec.to_builtins(_session_state())
    assert out["created_at"] == "2025-03-14T15:09:26.535000Z"
    assert json.loads(json.dumps(out)) == out


# ---- evolution rules --------------------------------------------------------------------


@pytest.mark.parametrize("cls", events.EVENT_TYPES, ids=events.tag_of)
def test_unknown_event_fields_are_ignored(cls: type[events.Event]) -> None:
    event = EVENT_FACTORIES[cls]()
    raw = json.loads(codec.encode(event))
    raw["added_in_a_newer_build"] = {"nested": [1, 2]}
    raw["meta"]["trace_flags"] = "01"
    assert codec.decode_event(json.dumps(raw).encode()) == event


def test_unknown_command_fields_are_ignored() -> None:
    command = COMMAND_FACTORIES[commands.StopSession]()
    raw = json.loads(codec.encode(command))
    raw["priority"] = 9
    assert codec.decode_command(json.dumps(raw).encode()) == command


def _stopped_raw(**changes: Any) -> dict[str, Any]:
    raw = json.loads(codec.encode(EVENT_FACTORIES[events.SessionStopped]()))
    raw.update(changes)
    return raw


@pytest.mark.parametrize(
    "raw",
    [
        _stopped_raw(type="session.exploded"),
        {k: v for k, v in _stopped_raw().items() if k != "type"},
        _stopped_raw(type=7),
        _stopped_raw(v=2),
        _stopped_raw(v=99),
        _stopped_raw(v=0),
        _stopped_raw(v="1"),
        _stopped_raw(session_id=None),
        {k: v for k, v in _stopped_raw().items() if k != "meta"},
        [1, 2, 3],
        "session.stopped",
    ],
    ids=[
        "unknown-tag",
        "no-tag",
        "non-string-tag",
        "newer-v2",
        "newer-v99",
        "v0",
        "v-as-string",
        "bad-field-type",
        "missing-meta",
        "array",
        "string",
    ],
)
def test_undecodable_event_raises_corrupt_event(raw: Any) -> None:
    with pytest.raises(errors.CorruptEvent):
        codec.decode_event(json.dumps(raw).encode())


@pytest.mark.parametrize("data", [b"", b"not json", b'{"type": "session.stopped"', b"\xff\xfe"])
def test_non_json_event_raises_corrupt_event(data: bytes) -> None:
    with pytest.raises(errors.CorruptEvent, match="not JSON"):
        codec.decode_event(data)


def test_upcaster_runs_for_older_version(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[dict[str, Any]] = []

    def v1_to_v2(raw: dict[str, Any]) -> dict[str, Any]:
        seen.append(dict(raw))
        raw["reason"] = "upcast:" + raw.pop("why")
        return raw

    monkeypatch.setitem(codec.CURRENT_VERSION, "session.stopped", 2)
    monkeypatch.setitem(codec.UPCASTERS, ("session.stopped", 1), v1_to_v2)
    raw = _stopped_raw()
    del raw["reason"]
    raw["why"] = "idle"  # the v1 shape used another field name
    event = codec.decode_event(json.dumps(raw).encode())
    assert len(seen) == 1 and seen[0]["v"] == 1 and seen[0]["why"] == "idle"
    assert type(event) is events.SessionStopped
    assert event.reason == "upcast:idle"
    assert event.v == 2
    assert event.session_id == SID and event.meta == _meta()


def test_upcaster_not_called_for_current_version(monkeypatch: pytest.MonkeyPatch) -> None:
    def explode(raw: dict[str, Any]) -> dict[str, Any]:
        raise AssertionError("upcaster must not run on a current payload")

    monkeypatch.setitem(codec.UPCASTERS, ("session.stopped", 1), explode)
    assert codec.decode_event(codec.encode(EVENT_FACTORIES[events.SessionStopped]())).v == 1


def test_missing_upcaster_raises_corrupt_event(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(codec.CURRENT_VERSION, "session.stopped", 3)
    monkeypatch.setitem(codec.UPCASTERS, ("session.stopped", 1), lambda raw: raw)
    with pytest.raises(errors.CorruptEvent, match="no upcaster"):
        codec.decode_event(json.dumps(_stopped_raw()).encode())


def test_upcaster_producing_bad_shape_raises_corrupt_event(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(codec.CURRENT_VERSION, "session.stopped", 2)
    monkeypatch.setitem(codec.UPCASTERS, ("session.stopped", 1), lambda raw: {**raw, "reason": 5})
    with pytest.raises(errors.CorruptEvent, match="does not match its schema"):
        codec.decode_event(json.dumps(_stopped_raw()).encode())


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"{",
        b"[]",
        b'"session.create"',
        b'{"type": "session.create"}',
        b'{"type": "session.explode", "command_id": "c", "session_id": "s"}',
        b'{"command_id": "c", "session_id": "s"}',
        b'{"type": "session.stop", "command_id": 5, "session_id": "s"}',
        b'{"type": "session.stop", "command_id": "c", "session_id": "s", "actor": "root"}',
        b"\xff",
    ],
)
def test_decode_command_rejects_malformed_input(data: bytes) -> None:
    with pytest.raises(errors.InvalidInput, match="malformed command"):
        codec.decode_command(data)
