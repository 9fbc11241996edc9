"""``sbx snapshot …``: take, list, show, delete, keep warm, fork and restore snapshots of sessions
(scheduler commands over NATS, as the REST API sends them; lists read the projection)."""

from __future__ import annotations

import asyncio
from typing import Any

from nats.aio.client import Client

from sbx_api import errors
from sbx_client import terminal
from shared.contract import codec, commands, ids, states, subjects
from shared.domain import describe, projections
from shared.infrastructure import eventstore, rpc

ACTOR = commands.Actor(via="cli")


def _line(s: states.SnapshotState) -> str:
    parent = f" parent {s.parent}" if s.parent else ""
    gone = f" ({s.status}: {s.delete_reason})" if s.status == "deleted" else ""
    warm = f"  {s.warm} kept warm" if s.warm else ""
    return (
        f"{s.snapshot_id}  session {s.session_id}  {s.created_at.isoformat(timespec='seconds')}  "
        f"{describe.size(s.size)} new, {describe.size(s.total_size)} in all, "
        f"{len(s.layers)} layer(s){parent}  "
        f"frozen {s.frozen_ms:.1f} ms{warm}{gone}"
    )


def _print(state: states.SnapshotState, as_json: bool) -> None:
    print(terminal.json_line(codec.to_builtins(state)) if as_json else terminal.escape(_line(state)))


async def create(
    nc: Client, topology: subjects.Topology, *, session: str, snapshot_id: str | None, as_json: bool
) -> int:
    snapshot_id = snapshot_id or f"snap-{ids.new_id()[:20]}"
    reply = await rpc.SessionClient(nc, topology).call(
        commands.SnapshotSession(
            command_id=ids.new_id(), session_id=session, snapshot_id=snapshot_id, actor=ACTOR
        )
    )
    assert reply.snapshot is not None
    _print(reply.snapshot, as_json)
    return 0


async def _states(nc: Client, topology: subjects.Topology) -> dict[str, states.SnapshotState]:
    from sbx import observe

    js = nc.jetstream()
    return await observe._all(js, projections.SNAPSHOTS, eventstore.EventStore(js, topology))


async def listing(
    nc: Client, topology: subjects.Topology, *, session: str | None, include_deleted: bool, as_json: bool
) -> int:
    rows = sorted(
        (
            s
            for s in (await _states(nc, topology)).values()
            if (include_deleted or s.status == "ready") and (session is None or s.session_id == session)
        ),
        key=lambda s: (s.created_at, s.snapshot_id),
    )
    for row in rows:
        _print(row, as_json)
    if not rows and not as_json:
        print("no snapshots")
    return 0


async def show(nc: Client, topology: subjects.Topology, *, snapshot_id: str, as_json: bool) -> int:
    found = next((s for s in (await _states(nc, topology)).values() if s.snapshot_id == snapshot_id), None)
    if found is None:
        raise errors.NotFound(f"snapshot {snapshot_id!r} does not exist")
    _print(found, as_json)
    return 0


async def delete(nc: Client, topology: subjects.Topology, *, snapshot_id: str, as_json: bool) -> int:
    found = next((s for s in (await _states(nc, topology)).values() if s.snapshot_id == snapshot_id), None)
    if found is None:
        raise errors.NotFound(f"snapshot {snapshot_id!r} does not exist")
    reply = await rpc.SessionClient(nc, topology).call(
        commands.DeleteSnapshot(
            command_id=ids.new_id(), session_id=found.session_id, snapshot_id=snapshot_id, actor=ACTOR
        )
    )
    assert reply.snapshot is not None
    _print(reply.snapshot, as_json)
    return 0


async def warm(
    nc: Client, topology: subjects.Topology, *, snapshot_id: str, count: int, as_json: bool
) -> int:
    found = next((s for s in (await _states(nc, topology)).values() if s.snapshot_id == snapshot_id), None)
    if found is None or found.status != "ready":
        raise errors.NotFound(f"snapshot {snapshot_id!r} does not exist")
    reply = await rpc.SessionClient(nc, topology).call(
        commands.WarmSnapshot(
            command_id=ids.new_id(),
            session_id=found.session_id,
            snapshot_id=snapshot_id,
            count=count,
            actor=ACTOR,
        )
    )
    assert reply.snapshot is not None
    _print(reply.snapshot, as_json)
    return 0


async def fork(
    nc: Client, topology: subjects.Topology, *, snapshot_id: str, session_ids: list[str], as_json: bool
) -> int:
    client = rpc.SessionClient(nc, topology)
    results: list[Any] = await asyncio.gather(
        *(
            client.session(
                commands.ForkSession(
                    command_id=ids.new_id(), session_id=sid, snapshot_id=snapshot_id, actor=ACTOR
                )
            )
            for sid in session_ids
        ),
        return_exceptions=True,
    )
    failed = 0
    for sid, result in zip(session_ids, results, strict=True):
        if isinstance(result, errors.SandboxError):
            failed += 1
            line: dict[str, Any] = {"session_id": sid, "error": result.code, "message": result.message}
            said = f"{sid}: not forked: {result.message}"
            print(terminal.json_line(line) if as_json else terminal.escape(said))
        elif isinstance(result, BaseException):
            raise result
        else:
            print(
                terminal.json_line(codec.to_builtins(result))
                if as_json
                else terminal.escape(f"{sid}: forked from {snapshot_id}")
            )
    return 1 if failed else 0


async def restore(
    nc: Client, topology: subjects.Topology, *, session: str, snapshot_id: str, as_json: bool
) -> int:
    state = await rpc.SessionClient(nc, topology).session(
        commands.RestoreSession(
            command_id=ids.new_id(), session_id=session, snapshot_id=snapshot_id, actor=ACTOR
        )
    )
    assert state is not None
    if as_json:
        print(terminal.json_line(codec.to_builtins(state)))
    else:
        print(terminal.escape(f"{session}: restored to {snapshot_id} (new sandbox {state.sandbox_id})"))
    return 0
