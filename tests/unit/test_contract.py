"""Wire contract (shared.contract.codec): every event, command, reply and state round-trips
and evolves safely."""

from __future__ import annotations

import json
import typing
from datetime import UTC, datetime
from typing import Any

import msgspec
import pytest

from sbx_api import errors
from shared.contract import codec, commands, events, execution, provisioning, states

T0 = datetime(2025, 3, 14, 15, 9, 26, 535000, tzinfo=UTC)
T1 = datetime(2025, 3, 14, 16, 0, 0, 1, tzinfo=UTC)
SID = "task-42"
SBX = "sb-7f3a9c2e41d84b6a0c5e"
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


def _sandbox_state(**overrides: Any) -> states.SandboxState:
    fields: dict[str, Any] = dict(
        sandbox_id=SBX,
        status="failed",
        session_id=SID,
        image="ghcr.io/org/img:1",
        run_as_root=False,
        writable_root=False,
        use_kata=True,
        backend="kata",
        created_at=T0,
        updated_at=T1,
        error="image pull failed: manifest unknown",
        last_seq=981,
    )
    fields.update(overrides)
    return states.SandboxState(**fields)


def _pool_meta() -> events.Meta:
    return _meta(service="pool-manager", instance="pool-manager-9b8c7d6e5f4a")


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
    events.SessionResumed: lambda: events.SessionResumed(meta=_meta(), session_id=SID),
    events.SessionSandboxAssigned: lambda: events.SessionSandboxAssigned(
        meta=_meta(), session_id=SID, sandbox_id=SBX, image="python:3.12"
    ),
    events.SessionSandboxReleased: lambda: events.SessionSandboxReleased(
        meta=_meta(), session_id=SID, sandbox_id=SBX, reason="sandbox lost"
    ),
    events.SessionDeadlineSet: lambda: events.SessionDeadlineSet(
        meta=_meta(), session_id=SID, end_at=datetime(2026, 12, 5, 3, 0, tzinfo=UTC)
    ),
    events.SandboxRequested: lambda: events.SandboxRequested(
        meta=_pool_meta(),
        sandbox_id=SBX,
        session_id=SID,
        image="ghcr.io/org/img:1",
        run_as_root=False,
        writable_root=False,
        use_kata=True,
        backend="kata",
    ),
    events.SandboxStarted: lambda: events.SandboxStarted(meta=_pool_meta(), sandbox_id=SBX),
    events.SandboxStopped: lambda: events.SandboxStopped(meta=_pool_meta(), sandbox_id=SBX, reason="idle"),
    events.SandboxDeleted: lambda: events.SandboxDeleted(meta=_pool_meta(), sandbox_id=SBX, reason="cleared"),
    events.SandboxFailed: lambda: events.SandboxFailed(
        meta=_pool_meta(), sandbox_id=SBX, error="image pull failed: manifest unknown"
    ),
    events.SandboxClaimed: lambda: events.SandboxClaimed(
        meta=_meta(instance="scheduler-4f2a9c1d7e3b"), sandbox_id=SBX, session_id=SID
    ),
    events.SandboxRefused: lambda: events.SandboxRefused(
        meta=_pool_meta(),
        sandbox_id=SBX,
        session_id=SID,
        reason="max_running (100) reached",
        running=100,
        limit=100,
    ),
    events.SandboxLost: lambda: events.SandboxLost(
        meta=_meta(service="reaper", instance="reaper-1a2b3c4d5e6f", command_id=None, session_id=None),
        sandbox_id=SBX,
        reason="runtime has nothing ✗",
    ),
    events.SandboxProxyAssigned: lambda: events.SandboxProxyAssigned(
        meta=_meta(service="proxy-scaler", instance="proxy-scaler-1a2b3c4d5e6f", session_id=None),
        sandbox_id=SBX,
        proxy_id="px-3129",
        reason="reassigned",
    ),
    events.SandboxCacheAttached: lambda: events.SandboxCacheAttached(
        meta=_meta(service="executor", instance="executor-1a2b3c4d5e6f"),
        sandbox_id=SBX,
        session_id=SID,
        org_id="acme",
    ),
    events.SandboxPaused: lambda: events.SandboxPaused(
        meta=_meta(service="pool-manager", instance="pool-manager-1a2b3c4d5e6f"),
        sandbox_id=SBX,
        reason="idle",
    ),
    events.SandboxResumed: lambda: events.SandboxResumed(
        meta=_meta(service="pool-manager", instance="pool-manager-1a2b3c4d5e6f"),
        sandbox_id=SBX,
        reason="call",
    ),
    events.ProxyStarted: lambda: events.ProxyStarted(
        meta=_meta(service="proxy-scaler", instance="proxy-scaler-1a2b3c4d5e6f", session_id=None),
        proxy_id="px-3129",
        endpoint="10.213.255.254:3129",
    ),
    events.ProxyDraining: lambda: events.ProxyDraining(
        meta=_meta(service="proxy-scaler", instance="proxy-scaler-1a2b3c4d5e6f", session_id=None),
        proxy_id="px-3129",
    ),
    events.ProxyStopped: lambda: events.ProxyStopped(
        meta=_meta(service="proxy-scaler", instance="proxy-scaler-1a2b3c4d5e6f", session_id=None),
        proxy_id="px-3129",
        reason="died",
    ),
    events.SnapshotCreated: lambda: events.SnapshotCreated(
        meta=_meta(service="pool-manager", instance="pool-manager-1a2b3c4d5e6f"),
        snapshot_id="snap-7f3a",
        session_id=SID,
        sandbox_id=SBX,
        org_id="acme",
        digest="sha256:" + "ab" * 32,
        layers=("cd" * 32, "ef" * 32),
        parent="snap-1a2b",
        size=4096,
        total_size=8192,
        files=12,
        image="python:3.12-slim",
        image_digest="sha256:" + "01" * 32,
        frozen_ms=3.25,
    ),
    events.SnapshotWarmSet: lambda: events.SnapshotWarmSet(
        meta=_meta(service="scheduler", instance="scheduler-1a2b3c4d5e6f"),
        snapshot_id="snap-7f3a",
        session_id=SID,
        count=20,
    ),
    events.SnapshotDeleted: lambda: events.SnapshotDeleted(
        meta=_meta(service="pool-manager", instance="pool-manager-1a2b3c4d5e6f"),
        snapshot_id="snap-7f3a",
        session_id=SID,
        reason="retention",
    ),
    events.CommandExecuted: lambda: events.CommandExecuted(
        meta=_meta(service="executor", instance="executor-0a1b2c3d4e5f"),
        session_id=SID,
        sandbox_id=SBX,
        tool="shell",
        command="pytest -q tests/ ✓",
        exit_code=1,
        duration_ms=4210,
        job_id=None,
        outcome="ok",
        error=None,
    ),
    events.ImagePullStarted: lambda: events.ImagePullStarted(
        meta=_meta(service="pool-manager", instance="pool-manager-1a2b3c4d5e6f"),
        reference="docker.io/library/python:3.12-slim",
        sandbox_id=SBX,
    ),
    events.ImagePulled: lambda: events.ImagePulled(
        meta=_meta(service="pool-manager", instance="pool-manager-1a2b3c4d5e6f"),
        reference="docker.io/library/python:3.12-slim",
        digest="sha256:" + "ab" * 32,
        size=45_000_000,
        layers=4,
        fetched=3,
        seconds=6.25,
    ),
    events.ImagePullFailed: lambda: events.ImagePullFailed(
        meta=_meta(service="sbx-cli", instance="host-4242", session_id=None),
        reference="ghcr.io/acme/private:1",
        error="invalid_input",
        reason="registry ghcr.io refused access to ghcr.io/acme/private:1",
    ),
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
    events.EgressRecorded: lambda: events.EgressRecorded(
        meta=_meta(service="proxy-scaler", instance="proxy-scaler-1a2b3c4d5e6f", command_id=None),
        session_id=SID,
        sandbox_id=SBX,
        proxy_id="px-3129",
        peer="10.213.0.6",
        connections=[
            events.EgressConnection(
                host="github.com",
                port=443,
                verdict="intercepted",
                rule="github",
                started=datetime(2025, 1, 15, 9, 30, tzinfo=UTC),
                duration_ms=820,
                requests=3,
                injected=3,
                bytes_up=2411,
                bytes_down=183422,
            ),
            events.EgressConnection(
                host="10.0.0.1",
                port=80,
                verdict="refused",
                reason="private_address",
                detail="10.0.0.1 is a private address",
                started=datetime(2025, 1, 15, 9, 30, 1, tzinfo=UTC),
                connections=40,
            ),
        ],
        aggregated=39,
    ),
}

COMMAND_FACTORIES: dict[type, Any] = {
    commands.CreateSession: lambda: commands.CreateSession(
        command_id="cmd-1", correlation_id="req-1", actor=ACTOR, session_id=SID, image="ghcr.io/org/img:1"
    ),
    commands.StopSession: lambda: commands.StopSession(
        command_id="cmd-2", actor=ACTOR, session_id=SID, reason="idle"
    ),
    commands.DeleteSession: lambda: commands.DeleteSession(
        command_id="cmd-3", correlation_id="req-3", session_id=SID, reason="retention"
    ),
    commands.EnsureSession: lambda: commands.EnsureSession(
        command_id="cmd-4", correlation_id="req-4", actor=ACTOR, session_id=SID, image="python:3.12"
    ),
    commands.ProvisionSandbox: lambda: commands.ProvisionSandbox(
        command_id="cmd-5",
        correlation_id="req-5",
        actor=ACTOR,
        session_id=SID,
        image="ghcr.io/org/img:1",
        use_kata=True,
        run_as_root=False,
        writable_root=False,
    ),
    commands.ClearSession: lambda: commands.ClearSession(
        command_id="cmd-6", actor=commands.Actor(via="cli", user_id="bob"), session_id=SID
    ),
    commands.PauseSession: lambda: commands.PauseSession(
        command_id="cmd-7",
        actor=commands.Actor(via="reaper"),
        session_id=SID,
        reason="idle",
        if_last_seq=41,
        quiet_since=datetime(2026, 12, 3, 8, 0, tzinfo=UTC),
        unless_jobs=True,
    ),
    commands.ResumeSession: lambda: commands.ResumeSession(
        command_id="pause:key-8", correlation_id="req-8", session_id=SID
    ),
    commands.HibernateSession: lambda: commands.HibernateSession(
        command_id="cmd-9",
        actor=commands.Actor(via="reaper"),
        session_id=SID,
        if_last_seq=44,
        quiet_since=datetime(2026, 12, 3, 8, 0, tzinfo=UTC),
        unless_jobs=True,
    ),
    commands.SnapshotSession: lambda: commands.SnapshotSession(
        command_id="cmd-10",
        actor=commands.Actor(via="rest", org_id="acme"),
        session_id=SID,
        snapshot_id="snap-1",
    ),
    commands.ForkSession: lambda: commands.ForkSession(
        command_id="cmd-11", session_id="task-42-fork-1", snapshot_id="snap-1"
    ),
    commands.RestoreSession: lambda: commands.RestoreSession(
        command_id="cmd-12", session_id=SID, snapshot_id="snap-1"
    ),
    commands.DeleteSnapshot: lambda: commands.DeleteSnapshot(
        command_id="cmd-13", session_id=SID, snapshot_id="snap-1", reason="requested"
    ),
    commands.WarmSnapshot: lambda: commands.WarmSnapshot(
        command_id="cmd-14", session_id=SID, snapshot_id="snap-1", count=20
    ),
    commands.SetDeadline: lambda: commands.SetDeadline(
        command_id="cmd-15", session_id=SID, end_at=datetime(2026, 12, 5, 3, 0, tzinfo=UTC)
    ),
}

REQUEST_BASE: dict[str, Any] = dict(
    session_id=SID, sandbox_id=SBX, actor=ACTOR, correlation_id="req-7c9e6679"
)
JOB = "0123456789abcdef0123456789abcdef"

EXEC_FACTORIES: dict[type, Any] = {
    execution.Shell: lambda: execution.Shell(**REQUEST_BASE, command="cd /workspace && ls -la", timeout=30.5),
    execution.ShellAsync: lambda: execution.ShellAsync(**REQUEST_BASE, command="make -j4 > build.log 2>&1"),
    execution.ShellPoll: lambda: execution.ShellPoll(**REQUEST_BASE, job_id=JOB),
    execution.ShellWait: lambda: execution.ShellWait(**REQUEST_BASE, job_id=JOB, timeout=600.0),
    execution.ShellStop: lambda: execution.ShellStop(session_id=SID, sandbox_id=SBX, job_id=JOB),
    execution.Edit: lambda: execution.Edit(
        **REQUEST_BASE,
        command="str_replace",
        path="/workspace/app.py",
        view_range=[1, -1],
        file_text=None,
        old_str="print('hi')\n",
        new_str="print('héllo')\n",
        insert_line=3,
        insert_text="import os\n",
    ),
    execution.Run: lambda: execution.Run(
        **REQUEST_BASE,
        inbox="_INBOX.a",
        stop="sbx.exec.stop.x.y",
        command="make test",
        cwd="/workspace/repo",
        env={"GIT_TRACE": "1"},
        unset=["TOKEN"],
        timeout=600.0,
        list_root="/workspace/repo",
        prune=["node_modules"],
    ),
    execution.PutFiles: lambda: execution.PutFiles(
        **REQUEST_BASE, inbox="_INBOX.b", stop="sbx.exec.stop.x.z", root="/workspace/repo", delete=["gone"]
    ),
    execution.GetFiles: lambda: execution.GetFiles(
        **REQUEST_BASE, inbox="_INBOX.c", stop="sbx.exec.stop.x.w", root="/workspace/repo"
    ),
    execution.ShellInput: lambda: execution.ShellInput(
        **REQUEST_BASE, job_id="a" * 32, data=b"\0x\n", close=False
    ),
    execution.ShellSignal: lambda: execution.ShellSignal(**REQUEST_BASE, job_id="b" * 32, signal="KILL"),
    execution.ShellJobs: lambda: execution.ShellJobs(**REQUEST_BASE),
    execution.ShellFollow: lambda: execution.ShellFollow(
        **REQUEST_BASE, inbox="_INBOX.f", stop="sbx.exec.stop.x.t", job_id="c" * 32, from_start=False
    ),
    execution.Files: lambda: execution.Files(
        **REQUEST_BASE, action="move", path="/tmp/a", destination="/workspace/b", depth=2
    ),
    execution.SandboxUsage: lambda: execution.SandboxUsage(**REQUEST_BASE),
    execution.Watch: lambda: execution.Watch(
        **REQUEST_BASE, action="create", path="/workspace", recursive=True
    ),
    execution.WatchDir: lambda: execution.WatchDir(
        **REQUEST_BASE, inbox="_INBOX.g", stop="sbx.exec.stop.x.s", path="/workspace/src", recursive=True
    ),
    execution.ReadFile: lambda: execution.ReadFile(
        **REQUEST_BASE, inbox="_INBOX.d", stop="sbx.exec.stop.x.v", path="/etc/hostname"
    ),
    execution.WriteFile: lambda: execution.WriteFile(
        **REQUEST_BASE, inbox="_INBOX.e", stop="sbx.exec.stop.x.u", path="/tmp/out.bin"
    ),
}

POOL_BASE: dict[str, Any] = dict(sandbox_id=SBX, command_id="cmd-4", correlation_id="req-4", actor=ACTOR)

POOL_FACTORIES: dict[type, Any] = {
    provisioning.Provision: lambda: provisioning.Provision(
        **POOL_BASE,
        session_id=SID,
        image="ghcr.io/org/img:1",
        run_as_root=False,
        writable_root=False,
        use_kata=True,
    ),
    provisioning.Start: lambda: provisioning.Start(**POOL_BASE),
    provisioning.Stop: lambda: provisioning.Stop(sandbox_id=SBX, command_id="cmd-2", reason="hibernated"),
    provisioning.Delete: lambda: provisioning.Delete(**POOL_BASE),
    provisioning.Pause: lambda: provisioning.Pause(**POOL_BASE, reason="idle"),
    provisioning.Resume: lambda: provisioning.Resume(**POOL_BASE, reason="call"),
    provisioning.Snapshot: lambda: provisioning.Snapshot(
        **POOL_BASE, snapshot_id="snap-1", session_id=SID, org_id="acme"
    ),
    provisioning.DropSnapshot: lambda: provisioning.DropSnapshot(
        **POOL_BASE, snapshot_id="snap-1", reason="retention"
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
        events.SessionResumed: "session.resumed",
        events.SessionSandboxAssigned: "session.sandbox_assigned",
        events.SessionSandboxReleased: "session.sandbox_released",
        events.SessionDeadlineSet: "session.deadline_set",
        events.SandboxRequested: "sandbox.requested",
        events.SandboxStarted: "sandbox.started",
        events.SandboxStopped: "sandbox.stopped",
        events.SandboxDeleted: "sandbox.deleted",
        events.SandboxFailed: "sandbox.failed",
        events.SandboxClaimed: "sandbox.claimed",
        events.SandboxRefused: "sandbox.refused",
        events.SandboxLost: "sandbox.lost",
        events.SandboxProxyAssigned: "sandbox.proxy_assigned",
        events.SandboxCacheAttached: "sandbox.cache_attached",
        events.SandboxPaused: "sandbox.paused",
        events.SandboxResumed: "sandbox.resumed",
        events.ProxyStarted: "proxy.started",
        events.ProxyDraining: "proxy.draining",
        events.ProxyStopped: "proxy.stopped",
        events.SnapshotCreated: "snapshot.created",
        events.SnapshotDeleted: "snapshot.deleted",
        events.SnapshotWarmSet: "snapshot.warm_set",
        events.CommandExecuted: "exec.completed",
        events.ImagePullStarted: "image.pull_started",
        events.ImagePulled: "image.pulled",
        events.ImagePullFailed: "image.pull_failed",
        events.InstanceStarted: "instance.started",
        events.InstanceStopped: "instance.stopped",
        events.EgressRecorded: "egress.recorded",
    }
    assert set(codec.CURRENT_VERSION) == {
        "session.created",
        "session.stopped",
        "session.deleted",
        "session.resumed",
        "session.sandbox_assigned",
        "session.sandbox_released",
        "session.deadline_set",
        "sandbox.requested",
        "sandbox.started",
        "sandbox.stopped",
        "sandbox.deleted",
        "sandbox.failed",
        "sandbox.claimed",
        "sandbox.refused",
        "sandbox.lost",
        "sandbox.proxy_assigned",
        "sandbox.cache_attached",
        "sandbox.paused",
        "sandbox.resumed",
        "proxy.started",
        "proxy.draining",
        "proxy.stopped",
        "snapshot.created",
        "snapshot.deleted",
        "snapshot.warm_set",
        "exec.completed",
        "image.pull_started",
        "image.pulled",
        "image.pull_failed",
        "instance.started",
        "instance.stopped",
        "egress.recorded",
    }


def test_command_tags_are_stable() -> None:
    tags = {cls: cls.__struct_config__.tag for cls in commands.COMMAND_TYPES}
    assert tags == {
        commands.CreateSession: "session.create",
        commands.StopSession: "session.stop",
        commands.DeleteSession: "session.delete",
        commands.EnsureSession: "session.ensure",
        commands.ProvisionSandbox: "session.provision",
        commands.ClearSession: "session.clear",
        commands.PauseSession: "session.pause",
        commands.ResumeSession: "session.resume",
        commands.HibernateSession: "session.hibernate",
        commands.SnapshotSession: "session.snapshot",
        commands.ForkSession: "session.fork",
        commands.RestoreSession: "session.restore",
        commands.DeleteSnapshot: "snapshot.delete",
        commands.WarmSnapshot: "snapshot.warm",
        commands.SetDeadline: "session.deadline",
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


STATE_FACTORIES: dict[type, Any] = {
    states.SessionState: lambda: _session_state(sandbox_id=SBX),
    states.InstanceState: _instance_state,
    states.SandboxState: _sandbox_state,
}


def test_state_factories_cover_every_state_type() -> None:
    assert set(STATE_FACTORIES) == set(typing.get_args(states.AnyState))


@pytest.mark.parametrize(
    "state",
    [
        _session_state(),
        _session_state(sandbox_id=SBX, status="active"),
        _instance_state(),
        _sandbox_state(),
        _sandbox_state(status="running", session_id=None, error=None),
        _sandbox_state(status="running", session_id=None, error=None, pool="default@0a1b2c3d", started_at=T1),
    ],
    ids=[
        "session",
        "session-with-sandbox",
        "instance",
        "sandbox-failed",
        "sandbox-running-unowned",
        "sandbox-warm-pool",
    ],
)
def test_state_round_trip(state: msgspec.Struct) -> None:
    decoded = codec.decode_state(codec.encode(state), type(state))
    assert type(decoded) is type(state)
    assert decoded == state


@pytest.mark.parametrize("cls", list(STATE_FACTORIES), ids=lambda c: c.__name__)
def test_state_factory_round_trip(cls: type[msgspec.Struct]) -> None:
    state = STATE_FACTORIES[cls]()
    assert type(state) is cls
    data = codec.encode(state)
    assert codec.decode_state(data, cls) == state
    assert codec.encode(codec.decode_state(data, cls)) == data


def test_sandbox_requested_without_pool_decodes_to_none() -> None:
    """Requests stored before warm pools have no ``pool``: they decode as a session's own sandbox."""
    event = EVENT_FACTORIES[events.SandboxRequested]()
    raw = json.loads(codec.encode(event))
    assert raw.pop("pool") is None
    decoded = codec.decode_event(json.dumps(raw).encode())
    assert isinstance(decoded, events.SandboxRequested) and decoded.pool is None
    assert decoded == event


def test_sandbox_requested_pool_round_trips() -> None:
    event = events.SandboxRequested(meta=_pool_meta(), sandbox_id=SBX, pool="default@0a1b2c3d")
    decoded = codec.decode_event(codec.encode(event))
    assert isinstance(decoded, events.SandboxRequested)
    assert (decoded.pool, decoded.session_id) == ("default@0a1b2c3d", None)


def test_sandbox_state_without_pool_fields_decodes_to_none() -> None:
    """Sandbox states stored before warm pools have no ``pool``/``started_at``: they must still load."""
    raw = json.loads(codec.encode(_sandbox_state()))
    assert raw.pop("pool") is None and raw.pop("started_at") is None
    assert codec.decode_state(json.dumps(raw).encode(), states.SandboxState) == _sandbox_state()


@pytest.mark.parametrize("status", ["refused", "lost"])
def test_sandbox_state_new_statuses_round_trip(status: str) -> None:
    state = _sandbox_state(status=status, pool="default@0a1b2c3d", started_at=T1, session_id=None)
    assert codec.decode_state(codec.encode(state), states.SandboxState) == state


def test_session_state_without_sandbox_field_decodes_to_none() -> None:
    """States stored before sandboxes existed have no ``sandbox_id``: they must still load."""
    raw = json.loads(codec.encode(_session_state()))
    del raw["sandbox_id"]
    assert codec.decode_state(json.dumps(raw).encode(), states.SessionState) == _session_state()


# ---- executor and pool-manager requests -------------------------------------------------


def _op(cls: type[msgspec.Struct]) -> str:
    tag = cls.__struct_config__.tag
    assert isinstance(tag, str)
    return tag


def test_exec_factories_cover_every_request_type() -> None:
    assert set(EXEC_FACTORIES) == set(execution.REQUEST_TYPES)
    assert set(execution.REQUEST_TYPES) == set(typing.get_args(execution.AnyRequest))


def test_pool_factories_cover_every_request_type() -> None:
    assert set(POOL_FACTORIES) == set(provisioning.POOL_REQUEST_TYPES)
    assert set(provisioning.POOL_REQUEST_TYPES) == set(typing.get_args(provisioning.AnyPoolRequest))


def test_request_ops_are_stable() -> None:
    assert {cls: _op(cls) for cls in execution.REQUEST_TYPES} == {
        execution.Shell: "shell",
        execution.ShellAsync: "shell_async",
        execution.ShellPoll: "shell_poll",
        execution.ShellWait: "shell_wait",
        execution.ShellStop: "shell_stop",
        execution.Edit: "edit",
        execution.Run: "run",
        execution.PutFiles: "put_files",
        execution.GetFiles: "get_files",
        execution.ShellInput: "shell_input",
        execution.ShellSignal: "shell_signal",
        execution.ShellJobs: "shell_jobs",
        execution.ShellFollow: "shell_follow",
        execution.Files: "files",
        execution.SandboxUsage: "usage",
        execution.Watch: "watch",
        execution.WatchDir: "watch_dir",
        execution.ReadFile: "read_file",
        execution.WriteFile: "write_file",
    }
    assert {cls: _op(cls) for cls in provisioning.POOL_REQUEST_TYPES} == {
        provisioning.Provision: "provision",
        provisioning.Start: "start",
        provisioning.Stop: "stop",
        provisioning.Delete: "delete",
        provisioning.Pause: "pause",
        provisioning.Resume: "resume",
        provisioning.Snapshot: "snapshot",
        provisioning.DropSnapshot: "snapshot_delete",
    }


@pytest.mark.parametrize("cls", execution.REQUEST_TYPES, ids=_op)
def test_exec_request_round_trip(cls: type[execution.Request]) -> None:
    request = EXEC_FACTORIES[cls]()
    assert type(request) is cls
    data = codec.encode(request)
    assert json.loads(data)["op"] == _op(cls)
    decoded = execution.decode_request(data)
    assert type(decoded) is cls
    assert decoded == request
    assert codec.encode(decoded) == data


@pytest.mark.parametrize("cls", execution.REQUEST_TYPES, ids=_op)
def test_exec_request_ignores_unknown_fields(cls: type[execution.Request]) -> None:
    request = EXEC_FACTORIES[cls]()
    raw = json.loads(codec.encode(request))
    raw["added_in_a_newer_build"] = [1]
    raw["actor"]["team"] = "blue"
    assert execution.decode_request(json.dumps(raw).encode()) == request


@pytest.mark.parametrize(
    "data",
    [
        b'{"op": "shell", "session_id": "s", "command": "ls"}',  # no sandbox_id
        b'{"op": "rm_rf", "session_id": "s", "sandbox_id": "b"}',
        b'{"session_id": "s", "sandbox_id": "b", "command": "ls"}',
        b'{"op": "edit", "session_id": "s", "sandbox_id": "b", "command": "delete", "path": "/x"}',
        b'{"op": "shell", "session_id": "s", "sandbox_id": "b", "command": "ls", "timeout": "soon"}',
        b"not json",
    ],
    ids=["missing-sandbox", "unknown-op", "no-op", "unknown-edit-command", "bad-timeout", "not-json"],
)
def test_exec_decode_request_rejects_malformed(data: bytes) -> None:
    with pytest.raises(msgspec.DecodeError):  # ValidationError is a subclass
        execution.decode_request(data)


@pytest.mark.parametrize(
    "reply",
    [
        execution.Reply(
            ok=True,
            output="total 0\n[... output truncated: 10 of 99 bytes omitted ...]\n",
            exit_code=0,
            truncated=True,
            duration=0.25,
        ),
        execution.Reply(ok=True, output="", exit_code=None, timed_out=True, duration=120.0),
        execution.Reply(ok=True, job_id=JOB, status="exited", exit_code=3, output="hello world\n"),
        execution.Reply(ok=True, job_id=JOB, status="lost"),
        execution.Reply(ok=False, error=commands.ErrorInfo("not_found", f"no job {JOB} in this session")),
    ],
    ids=["shell-truncated", "shell-timeout", "poll-exited", "poll-lost", "error"],
)
def test_exec_reply_round_trip(reply: execution.Reply) -> None:
    data = codec.encode(reply)
    assert execution.decode_reply(data) == reply
    assert codec.encode(execution.decode_reply(data)) == data


def test_exec_reply_rejects_unknown_job_status() -> None:
    raw = json.loads(codec.encode(execution.Reply(ok=True, job_id=JOB, status="running")))
    raw["status"] = "zombie"
    with pytest.raises(msgspec.ValidationError):
        execution.decode_reply(json.dumps(raw).encode())


@pytest.mark.parametrize("cls", provisioning.POOL_REQUEST_TYPES, ids=_op)
def test_pool_request_round_trip(cls: type[provisioning.PoolRequest]) -> None:
    request = POOL_FACTORIES[cls]()
    assert type(request) is cls
    data = codec.encode(request)
    assert json.loads(data)["op"] == _op(cls)
    decoded = provisioning.decode_request(data)
    assert type(decoded) is cls
    assert decoded == request
    assert codec.encode(decoded) == data


@pytest.mark.parametrize(
    "data",
    [
        b'{"op": "provision", "command_id": "c"}',
        b'{"op": "explode", "sandbox_id": "b", "command_id": "c"}',
        b'{"sandbox_id": "b", "command_id": "c"}',
        b'{"op": "provision", "sandbox_id": "b", "command_id": "c", "use_kata": "yes"}',
        b"[]",
    ],
    ids=["missing-sandbox", "unknown-op", "no-op", "bad-flag", "array"],
)
def test_pool_decode_request_rejects_malformed(data: bytes) -> None:
    with pytest.raises(msgspec.DecodeError):
        provisioning.decode_request(data)


@pytest.mark.parametrize(
    "reply",
    [
        provisioning.PoolReply(ok=True, sandbox=_sandbox_state(status="running", error=None)),
        provisioning.PoolReply(ok=True, sandbox=_sandbox_state()),
        provisioning.PoolReply(ok=True, sandbox=None),
        provisioning.PoolReply(ok=False, error=commands.ErrorInfo("not_found", f"no sandbox {SBX!r}")),
    ],
    ids=["running", "failed", "no-sandbox", "error"],
)
def test_pool_reply_round_trip(reply: provisioning.PoolReply) -> None:
    data = codec.encode(reply)
    assert provisioning.decode_reply(data) == reply
    assert codec.encode(provisioning.decode_reply(data)) == data


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


@pytest.mark.parametrize("cls", [commands.StopSession, commands.DeleteSession], ids=["stop", "delete"])
def test_stop_and_delete_without_reason_default_to_requested(cls: type[commands.Command]) -> None:
    raw = json.loads(codec.encode(COMMAND_FACTORIES[cls]()))
    assert raw.pop("reason") != "requested"
    decoded = codec.decode_command(json.dumps(raw).encode())
    assert type(decoded) is cls and decoded.reason == "requested"  # type: ignore[attr-defined]


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
