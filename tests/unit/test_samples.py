"""Frozen wire samples in tests/samples must keep decoding to the same events and commands forever."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
import pytest

from shared.contract import codec, commands, events

SAMPLES = Path(__file__).resolve().parents[1] / "samples"
EVENT_FILES = sorted((SAMPLES / "events").glob("*.json"))
COMMAND_FILES = sorted((SAMPLES / "commands").glob("*.json"))
T = datetime(2025, 1, 15, 9, 30, 0, 123456, tzinfo=UTC)
SB = "sb-4e7a1c9b2d0f8a6e3b5c"

#: file name -> (type, key fields as attribute paths). Every sample file must be listed.
EXPECTED: dict[str, tuple[type, dict[str, Any]]] = {
    "session.created.json": (
        events.SessionCreated,
        {
            "session_id": "task-42",
            "image": "python:3.12",
            "org_id": "acme",
            "user_id": "alice",
            "meta.command_id": "3f2b8e1c9d0a47b6a5c4d3e2f1a0b9c8",
            "meta.correlation_id": "req-0001",
            "meta.time": T,
            "meta.service": "scheduler",
        },
    ),
    "session.created.minimal.json": (
        events.SessionCreated,
        {
            "session_id": "s1",
            "image": None,
            "org_id": None,
            "user_id": None,
            "meta.command_id": "0000000000000000000000000000000a",
            "meta.time": T,
        },
    ),
    "session.stopped.json": (
        events.SessionStopped,
        {"session_id": "task-42", "reason": "requested", "meta.event_id": "8c1f0e2d3b4a59687766554433221100"},
    ),
    "session.deleted.json": (
        events.SessionDeleted,
        {"session_id": "task-42", "reason": "expired", "meta.user_id": "alice"},
    ),
    "instance.started.json": (
        events.InstanceStarted,
        {
            "service": "executor",
            "instance": "executor-0a1b2c3d4e5f",
            "pid": 31337,
            "host": "node-7",
            "version": "0.1.0",
            "meta.time": T,
            "meta.command_id": None,
        },
    ),
    "instance.stopped.json": (
        events.InstanceStopped,
        {"service": "executor", "instance": "executor-0a1b2c3d4e5f", "reason": "signal"},
    ),
    "session.resumed.json": (
        events.SessionResumed,
        {
            "session_id": "task-42",
            "meta.command_id": "6a5b4c3d2e1f0a9b8c7d6e5f4a3b2c1d",
            "meta.correlation_id": "req-0003",
            "meta.time": T,
        },
    ),
    "session.sandbox_assigned.json": (
        events.SessionSandboxAssigned,
        {"session_id": "task-42", "sandbox_id": SB, "image": "python:3.12", "meta.service": "scheduler"},
    ),
    "session.deadline_set.json": (
        events.SessionDeadlineSet,
        {"session_id": "e2b-task", "end_at": datetime(2026, 12, 5, 3, 0, tzinfo=UTC)},
    ),
    "session.created.e2b.json": (
        events.SessionCreated,
        {
            "session_id": "e2b-task",
            "metadata": {"purpose": "eval"},
            "env": {"LANG": "C.UTF-8"},
            "end_at": datetime(2026, 12, 5, 2, 55, tzinfo=UTC),
        },
    ),
    "session.sandbox_released.json": (
        events.SessionSandboxReleased,
        {
            "session_id": "task-42",
            "sandbox_id": SB,
            "reason": "reprovision",
            "meta.correlation_id": "req-0004",
        },
    ),
    "sandbox.requested.json": (
        events.SandboxRequested,
        {
            "sandbox_id": SB,
            "session_id": "task-42",
            "image": "python:3.12",
            "run_as_root": True,
            "writable_root": True,
            "use_kata": False,
            "backend": "local",
            "pool": None,  # stored before warm pools existed: the field is absent and must default
            "meta.service": "pool-manager",
            "meta.time": T,
        },
    ),
    "sandbox.started.json": (
        events.SandboxStarted,
        {"sandbox_id": SB, "meta.instance": "pool-manager-b2c3d4e5f6a7", "meta.session_id": "task-42"},
    ),
    "sandbox.stopped.json": (
        events.SandboxStopped,
        {"sandbox_id": SB, "reason": "requested", "meta.user_id": None, "meta.correlation_id": "req-0002"},
    ),
    "sandbox.deleted.json": (
        events.SandboxDeleted,
        {"sandbox_id": SB, "reason": "cleared", "meta.user_id": "bob", "meta.correlation_id": None},
    ),
    "sandbox.failed.json": (
        events.SandboxFailed,
        {"sandbox_id": SB, "error": "image pull failed: manifest unknown", "meta.service": "pool-manager"},
    ),
    "sandbox.claimed.json": (
        events.SandboxClaimed,
        {
            "sandbox_id": SB,
            "session_id": "task-42",
            "meta.service": "scheduler",
            "meta.command_id": "5c4b3a2f1e0d9c8b7a6f5e4d3c2b1a0f",
            "meta.correlation_id": "req-0003",
            "meta.time": T,
        },
    ),
    "sandbox.refused.json": (
        events.SandboxRefused,
        {
            "sandbox_id": SB,
            "session_id": "task-42",
            "reason": "max_running (100) reached",
            "running": 100,
            "limit": 100,
            "meta.service": "pool-manager",
            "meta.user_id": "alice",
        },
    ),
    "sandbox.proxy_assigned.json": (
        events.SandboxProxyAssigned,
        {"sandbox_id": SB, "proxy_id": "px-3129", "reason": "new"},
    ),
    "sandbox.cache_attached.json": (
        events.SandboxCacheAttached,
        {"sandbox_id": SB, "session_id": "task-42", "org_id": "acme", "meta.service": "executor"},
    ),
    "sandbox.paused.json": (
        events.SandboxPaused,
        {"sandbox_id": SB, "reason": "idle", "meta.service": "pool-manager", "meta.session_id": "task-42"},
    ),
    "sandbox.resumed.json": (
        events.SandboxResumed,
        {"sandbox_id": SB, "reason": "call", "meta.correlation_id": "req-0042"},
    ),
    "proxy.started.json": (
        events.ProxyStarted,
        {"proxy_id": "px-3129", "backend": "local", "endpoint": "10.213.255.254:3129"},
    ),
    "proxy.draining.json": (events.ProxyDraining, {"proxy_id": "px-3129", "reason": "scale-down"}),
    "proxy.stopped.json": (events.ProxyStopped, {"proxy_id": "px-3129", "reason": "drained"}),
    "snapshot.created.json": (
        events.SnapshotCreated,
        {
            "snapshot_id": "snap-7f3a",
            "session_id": "task-42",
            "org_id": "acme",
            "size": 1048576,
            "parent": None,
            "frozen_ms": 4.5,
            "meta.service": "pool-manager",
        },
    ),
    "snapshot.deleted.json": (
        events.SnapshotDeleted,
        {"snapshot_id": "snap-7f3a", "session_id": "task-42", "reason": "requested"},
    ),
    "snapshot.warm_set.json": (
        events.SnapshotWarmSet,
        {"snapshot_id": "snap-7f3a", "session_id": "task-42", "count": 20, "meta.service": "scheduler"},
    ),
    "sandbox.lost.json": (
        events.SandboxLost,
        {
            "sandbox_id": SB,
            "reason": "missing from the runtime",
            "meta.service": "reaper",
            "meta.instance": "reaper-c3d4e5f6a7b8",
            "meta.command_id": None,
            "meta.session_id": None,
            "meta.time": T,
        },
    ),
    "exec.completed.json": (
        events.CommandExecuted,
        {
            "session_id": "task-42",
            "sandbox_id": SB,
            "tool": "shell",
            "command": "pytest -q tests/unit",
            "exit_code": 1,
            "duration_ms": 4210,
            "job_id": None,
            "outcome": "ok",
            "error": None,
            "meta.service": "executor",
            "meta.command_id": None,
        },
    ),
    "egress.recorded.json": (
        events.EgressRecorded,
        {
            "session_id": "task-42",
            "sandbox_id": SB,
            "proxy_id": "px-0a1b2c3d4e5f",
            "peer": "10.213.0.6",
            "aggregated": 1,
            "lost": 0,
            "meta.service": "proxy-scaler",
            "meta.session_id": "task-42",
        },
    ),
    "image.pull_started.json": (
        events.ImagePullStarted,
        {"reference": "docker.io/library/python:3.12-slim", "sandbox_id": SB, "meta.service": "pool-manager"},
    ),
    "image.pulled.json": (
        events.ImagePulled,
        {
            "reference": "docker.io/library/python:3.12-slim",
            "digest": "sha256:" + "ab" * 32,
            "size": 45_000_000,
            "layers": 4,
            "fetched": 3,
            "seconds": 6.25,
        },
    ),
    "image.pull_failed.json": (
        events.ImagePullFailed,
        {"reference": "ghcr.io/acme/private:1", "error": "invalid_input"},
    ),
    "session.create.json": (
        commands.CreateSession,
        {
            "command_id": "3f2b8e1c9d0a47b6a5c4d3e2f1a0b9c8",
            "correlation_id": "req-0001",
            "session_id": "task-42",
            "image": "python:3.12",
            "actor.via": "rest",
            "actor.org_id": "acme",
            "actor.user_id": "alice",
        },
    ),
    "session.create.minimal.json": (
        commands.CreateSession,
        {"command_id": "c-1", "session_id": "s1", "image": None, "correlation_id": None, "actor.via": "rest"},
    ),
    "session.pause.json": (
        commands.PauseSession,
        {
            "session_id": "task-42",
            "reason": "idle",
            "if_last_seq": 17,
            "unless_jobs": True,
            "actor.via": "reaper",
        },
    ),
    "session.snapshot.json": (
        commands.SnapshotSession,
        {"session_id": "task-42", "snapshot_id": "snap-7f3a", "actor.via": "rest", "actor.org_id": "acme"},
    ),
    "session.fork.json": (
        commands.ForkSession,
        {"session_id": "task-42-try-2", "snapshot_id": "snap-7f3a", "actor.via": "cli"},
    ),
    "session.restore.json": (
        commands.RestoreSession,
        {"session_id": "task-42", "snapshot_id": "snap-7f3a"},
    ),
    "snapshot.delete.json": (
        commands.DeleteSnapshot,
        {"session_id": "task-42", "snapshot_id": "snap-7f3a", "reason": "requested"},
    ),
    "snapshot.warm.json": (
        commands.WarmSnapshot,
        {"session_id": "task-42", "snapshot_id": "snap-7f3a", "count": 20, "actor.org_id": "acme"},
    ),
    "session.hibernate.json": (
        commands.HibernateSession,
        {"session_id": "task-42", "reason": "idle", "if_last_seq": 23, "unless_jobs": True},
    ),
    "session.resume.json": (
        commands.ResumeSession,
        {"command_id": "resume:op-2026-12-03-1", "session_id": "task-42", "actor.org_id": "acme"},
    ),
    "session.stop.json": (
        commands.StopSession,
        {
            "command_id": "9e8d7c6b5a4f3e2d1c0b9a8f7e6d5c4b",
            "session_id": "task-42",
            "reason": "requested",  # stored before reasons existed
            "actor.via": "mcp",
            "actor.org_id": "acme",
            "actor.user_id": None,
        },
    ),
    "session.delete.json": (
        commands.DeleteSession,
        {
            "command_id": "1a2b3c4d5e6f7a8b9c0d1e2f3a4b5c6d",
            "session_id": "task-42",
            "reason": "requested",  # stored before reasons existed
            "actor.via": "cli",
            "actor.user_id": "bob",
        },
    ),
    "session.deadline.json": (
        commands.SetDeadline,
        {"session_id": "e2b-task", "actor.via": "e2b", "end_at": datetime(2026, 12, 5, 3, 0, tzinfo=UTC)},
    ),
    "session.ensure.json": (
        commands.EnsureSession,
        {
            "command_id": "5c4b3a2f1e0d9c8b7a6f5e4d3c2b1a0f",
            "correlation_id": "req-0003",
            "session_id": "task-42",
            "image": None,
            "actor.via": "mcp",
            "actor.org_id": "acme",
            "actor.user_id": "alice",
        },
    ),
    "session.provision.json": (
        commands.ProvisionSandbox,
        {
            "command_id": "4b3a2f1e0d9c8b7a6f5e4d3c2b1a0f9e",
            "session_id": "task-42",
            "image": "ghcr.io/acme/agent:2.1",
            "use_kata": True,
            "run_as_root": False,
            "writable_root": False,
            "actor.via": "mcp",
        },
    ),
    "session.clear.json": (
        commands.ClearSession,
        {
            "command_id": "3a2f1e0d9c8b7a6f5e4d3c2b1a0f9e8d",
            "correlation_id": None,
            "session_id": "task-42",
            "actor.via": "mcp",
            "actor.user_id": None,
        },
    ),
}


def _get(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _tag(obj: msgspec.Struct) -> str:
    return type(obj).__struct_config__.tag


def _assert_expected(path: Path, decoded: msgspec.Struct) -> None:
    assert path.name in EXPECTED, f"{path.name}: add its expected type and key fields to EXPECTED"
    cls, fields = EXPECTED[path.name]
    assert type(decoded) is cls
    assert path.name.split(".json")[0].startswith(_tag(decoded)), "file name must start with its type tag"
    for attr, want in fields.items():
        assert _get(decoded, attr) == want, f"{path.name}: {attr}"


def _assert_no_field_lost(stored: Any, reencoded: Any, where: str) -> None:
    """Every stored key survives decoding unchanged (a rename without a version bump loses data)."""
    if isinstance(stored, dict):
        assert isinstance(reencoded, dict), where
        for key, value in stored.items():
            assert key in reencoded, f"{where}.{key} is no longer understood"
            _assert_no_field_lost(value, reencoded[key], f"{where}.{key}")
    else:
        assert stored == reencoded, where


def test_sample_folders_exist_and_are_not_empty() -> None:
    assert EVENT_FILES and COMMAND_FILES


def test_every_sample_file_has_expectations_and_vice_versa() -> None:
    names = [p.name for p in EVENT_FILES + COMMAND_FILES]
    assert len(names) == len(set(names))
    assert set(names) == set(EXPECTED)


@pytest.mark.parametrize("path", EVENT_FILES, ids=lambda p: p.name)
def test_event_sample_decodes(path: Path) -> None:
    data = path.read_bytes()
    event = codec.decode_event(data)
    _assert_expected(path, event)
    assert event.v == codec.CURRENT_VERSION[_tag(event)]  # old shapes arrive upcast
    stored = json.loads(data)
    if stored["v"] == event.v:  # same schema version: nothing may be silently dropped
        _assert_no_field_lost(stored, json.loads(codec.encode(event)), path.name)


@pytest.mark.parametrize("path", COMMAND_FILES, ids=lambda p: p.name)
def test_command_sample_decodes(path: Path) -> None:
    data = path.read_bytes()
    command = codec.decode_command(data)
    _assert_expected(path, command)
    _assert_no_field_lost(json.loads(data), json.loads(codec.encode(command)), path.name)


def test_every_event_type_has_a_sample() -> None:
    covered = {type(codec.decode_event(p.read_bytes())) for p in EVENT_FILES}
    missing = {events.tag_of(c) for c in events.EVENT_TYPES} - {events.tag_of(c) for c in covered}
    assert not missing, f"add a sample under tests/samples/events for: {sorted(missing)}"


def test_requested_sample_without_pool_decodes_to_no_pool() -> None:
    """sandbox.requested stored before warm pools has no ``pool`` key: it is a session's own sandbox."""
    path = SAMPLES / "events" / "sandbox.requested.json"
    assert "pool" not in json.loads(path.read_bytes())
    event = codec.decode_event(path.read_bytes())
    assert isinstance(event, events.SandboxRequested)
    assert event.pool is None and event.session_id == "task-42"


def test_every_command_type_has_a_sample() -> None:
    covered = {type(codec.decode_command(p.read_bytes())) for p in COMMAND_FILES}
    missing = {c.__struct_config__.tag for c in commands.COMMAND_TYPES} - {
        c.__struct_config__.tag for c in covered
    }
    assert not missing, f"add a sample under tests/samples/commands for: {sorted(missing)}"
