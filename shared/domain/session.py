"""A session: its state fold and the pure rules that decide its events.

``decide(state, command, meta) -> events``: no I/O and no clock; the caller supplies
``meta`` (which carries the time). A command whose id caused the state's last event is
a duplicate and decides nothing, which makes redelivery harmless. ``evolve`` folds one
event into the state; it raises :class:`~sbx_api.errors.InvalidTransition` for an
event that cannot follow (``decide`` never emits one, so seeing it means a corrupt
stream). A deleted session stays as a ``status="deleted"`` tombstone, so a late or
replayed event never resurrects it; creating the id again starts a new incarnation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Required, TypedDict

import msgspec

from sbx_api import errors
from shared.contract import commands, events, ids, labels, states


# One case per event, so a session's lifecycle reads as one table.
def evolve(  # noqa: C901
    state: states.SessionState | None, event: events.Event, seq: int
) -> states.SessionState:
    def refuse(why: str) -> errors.InvalidTransition:
        return errors.InvalidTransition(
            f"{events.tag_of(type(event))} at seq {seq} cannot follow "
            f"{state.status if state else 'nothing'}: {why}"
        )

    def step(current: states.SessionState, **changes: object) -> states.SessionState:
        return msgspec.structs.replace(
            current,
            updated_at=event.meta.time,
            version=current.version + 1,
            last_seq=seq,
            last_command_id=event.meta.command_id,
            **changes,
        )

    match event:
        case events.SessionCreated():
            if state is not None and state.status != "deleted":
                raise refuse("the session already exists")
            return states.SessionState(
                session_id=event.session_id,
                status="active",
                image=event.image,
                org_id=event.org_id,
                user_id=event.user_id,
                forked_from=event.forked_from,
                metadata=event.metadata,
                env=event.env,
                end_at=event.end_at,
                created_at=event.meta.time,
                updated_at=event.meta.time,
                incarnation=state.incarnation + 1 if state else 1,
                version=state.version + 1 if state else 1,
                last_seq=seq,
                last_command_id=event.meta.command_id,
            )
        case events.SessionStopped():
            if state is None or state.status != "active":
                raise refuse("only an active session can stop")
            return step(state, status="stopped")
        case events.SessionDeleted():
            if state is None or state.status == "deleted":
                raise refuse("the session does not exist")
            return step(state, status="deleted", sandbox_id=None)
        case events.SessionResumed():
            if state is None or state.status != "stopped":
                raise refuse("only a stopped session can resume")
            return step(state, status="active")
        case events.SessionSandboxAssigned():
            if state is None or state.status != "active" or state.sandbox_id is not None:
                raise refuse("a sandbox is assigned only to an active session without one")
            return step(state, sandbox_id=event.sandbox_id, image=event.image)
        case events.SessionSandboxReleased():
            if state is None or state.sandbox_id != event.sandbox_id:
                raise refuse("only the assigned sandbox can be released")
            return step(state, sandbox_id=None)
        case events.SessionDeadlineSet():
            if state is None or state.status == "deleted":
                raise refuse("the session does not exist")
            return step(state, end_at=event.end_at)
        case _:
            raise refuse("not a session event")


def _foreign(state: states.SessionState, command: commands.SessionCommand) -> bool:
    """Whether the session belongs to another organisation than the caller acts for."""
    org = command.actor.org_id
    return org is not None and state.org_id not in (None, org)


def validate(command: commands.SessionCommand) -> None:
    """Reject malformed commands before any state is read (never trust the bus)."""
    ids.validate_session_id(command.session_id)
    ids.validate_attribution(command.actor.org_id, what="org id")
    ids.validate_attribution(command.actor.user_id, what="user id")
    if isinstance(command, commands.CreateSession | commands.EnsureSession | commands.ProvisionSandbox):
        ids.validate_image(command.image)
    if isinstance(command, commands.SnapshotCommand):
        ids.validate_session_id(command.snapshot_id, what="snapshot id")
    if isinstance(command, commands.EnsureSession | commands.ForkSession):
        labels.validate_metadata(command.metadata)
        labels.validate_env(command.env)


# Long on purpose: one case per command, each with its guard, as one table.
def decide(  # noqa: C901
    state: states.SessionState | None,
    command: commands.SessionCommand,
    meta: events.Meta,
) -> list[events.SessionEvent]:
    if state is not None and state.last_command_id == command.command_id:
        return []
    exists = state is not None and state.status != "deleted"
    sid = command.session_id
    # A caller acting for an organisation never reaches another organisation's session
    # (a caller without one, the operator, reaches every session; a session without one
    # belongs to no tenant).
    if exists and state is not None and _foreign(state, command):
        match command:
            case commands.ClearSession():
                return []
            case (
                commands.StopSession()
                | commands.DeleteSession()
                | commands.PauseSession()
                | commands.ResumeSession()
                | commands.HibernateSession()
                | commands.SnapshotSession()
                | commands.RestoreSession()
                | commands.SetDeadline()
            ):
                raise errors.NotFound(f"session {sid!r} does not exist")
            case commands.CreateSession():
                pass  # "already exists", below: the id is taken, whoever took it
            case _:
                raise errors.Conflict(f"session id {sid!r} is taken by another organisation; choose another")
    precondition = getattr(command, "if_last_seq", None)
    if precondition is not None and (state is None or state.last_seq != precondition):
        return []  # the session moved on since the sender's snapshot: leave it alone
    match command:
        case commands.CreateSession():
            if exists:
                assert state is not None
                raise errors.Conflict(f"session {sid!r} already exists (status: {state.status})")
            return [
                events.SessionCreated(
                    meta=meta,
                    session_id=sid,
                    image=command.image,
                    org_id=command.actor.org_id,
                    user_id=command.actor.user_id,
                )
            ]
        case commands.StopSession():
            if not exists:
                raise errors.NotFound(f"session {sid!r} does not exist")
            assert state is not None
            if state.status == "stopped":
                return []
            return [events.SessionStopped(meta=meta, session_id=sid, reason=command.reason)]
        case commands.DeleteSession():
            if not exists:
                raise errors.NotFound(f"session {sid!r} does not exist")
            return [events.SessionDeleted(meta=meta, session_id=sid, reason=command.reason)]
        case commands.ClearSession():
            return [events.SessionDeleted(meta=meta, session_id=sid, reason="cleared")] if exists else []
        case commands.EnsureSession() | commands.ProvisionSandbox():
            if not exists:
                ensure = command if isinstance(command, commands.EnsureSession) else None
                return [
                    events.SessionCreated(
                        meta=meta,
                        session_id=sid,
                        image=command.image,
                        org_id=command.actor.org_id,
                        user_id=command.actor.user_id,
                        metadata=ensure.metadata if ensure else {},
                        env=ensure.env if ensure else {},
                        end_at=ensure.end_at if ensure else None,
                    )
                ]
            assert state is not None
            return [events.SessionResumed(meta=meta, session_id=sid)] if state.status == "stopped" else []
        case commands.PauseSession() | commands.ResumeSession() | commands.HibernateSession():
            if not exists:
                raise errors.NotFound(f"session {sid!r} does not exist")
            return []  # the sandbox's transition, not the session's: see ``pause_target``
        case commands.SnapshotSession() | commands.RestoreSession():
            if not exists:
                raise errors.NotFound(f"session {sid!r} does not exist")
            assert state is not None
            if state.status != "active":
                raise errors.Conflict(f"session {sid!r} is {state.status}: resume it first")
            return []  # a snapshot's events, or a sandbox swap: see the scheduler
        case commands.ForkSession():
            if exists:
                assert state is not None
                raise errors.Conflict(f"session {sid!r} already exists (status: {state.status})")
            return []  # created with its sandbox: see ``decide_fork``
        case commands.SetDeadline():
            if not exists:
                raise errors.NotFound(f"session {sid!r} does not exist")
            assert state is not None
            if state.end_at == command.end_at:
                return []
            return [events.SessionDeadlineSet(meta=meta, session_id=sid, end_at=command.end_at)]
    return []


def decide_fork(
    state: states.SessionState | None,
    command: commands.ForkSession,
    snapshot: states.SnapshotState,
    sandbox_id: str,
    meta: events.Meta,
) -> list[events.SessionEvent]:
    """A fork: the new session, of the snapshot's organisation, created with its sandbox
    (started from the snapshot) in one append. Nothing if the id was taken meanwhile (the
    caller then deletes the sandbox and says so)."""
    if (state is not None and state.status != "deleted") or decide(state, command, meta):
        return []
    sid = command.session_id
    return [
        events.SessionCreated(
            meta=meta,
            session_id=sid,
            image=snapshot.image,
            org_id=snapshot.org_id,
            user_id=command.actor.user_id,
            forked_from=snapshot.snapshot_id,
            metadata=command.metadata,
            env=command.env,
            end_at=command.end_at,
        ),
        events.SessionSandboxAssigned(meta=meta, session_id=sid, sandbox_id=sandbox_id, image=snapshot.image),
    ]


def pause_target(
    state: states.SessionState | None,
    command: commands.PauseSession | commands.ResumeSession | commands.HibernateSession,
) -> str | None:
    """The sandbox a pause, resume or hibernation acts on: the session's, while it is active. None when
    the session moved on since the sender's snapshot (``if_last_seq``): nothing to do.
    Raises NotFound (no such session, or another organisation's) and Conflict (a session
    with no sandbox to pause: never used, stopped)."""
    if state is None or state.status == "deleted" or _foreign(state, command):
        raise errors.NotFound(f"session {command.session_id!r} does not exist")
    precondition = getattr(command, "if_last_seq", None)
    if precondition is not None and state.last_seq != precondition:
        return None
    if state.status != "active" or state.sandbox_id is None:
        why = "it is stopped" if state.status == "stopped" else "it has none yet"
        raise errors.Conflict(
            f"session {command.session_id!r} has no running sandbox to pause or resume: {why}"
        )
    return state.sandbox_id


def decide_assign(
    state: states.SessionState | None, sandbox_id: str, image: str, meta: events.Meta
) -> list[events.SessionEvent]:
    """Give an active session without a sandbox this one; anything else decides nothing
    (the caller then discards the sandbox it provisioned)."""
    if state is None or state.status != "active" or state.sandbox_id is not None:
        return []
    return [
        events.SessionSandboxAssigned(
            meta=meta, session_id=state.session_id, sandbox_id=sandbox_id, image=image
        )
    ]


def decide_new_with_sandbox(
    state: states.SessionState | None,
    command: commands.EnsureSession,
    sandbox_id: str,
    image: str,
    org: str | None,
    meta: events.Meta,
) -> list[events.SessionEvent]:
    """A session's first request: created (or resumed) and given ``sandbox_id``, obtained
    for organisation ``org``, in one append. If another request created it meanwhile and
    gave it a sandbox, or made it for another organisation (or none: then the sandbox,
    which may show ``org``'s cache, is not for it), only what ``decide`` says; the caller
    then discards ``sandbox_id`` and serves the session as it is."""
    first = decide(state, command, meta)
    after = state
    for event in first:
        after = evolve(after, event, (after.last_seq if after else 0) + 1)
    if after is None or after.org_id != org:
        return first
    return [*first, *decide_assign(after, sandbox_id, image, meta)]


def decide_swap(
    state: states.SessionState | None, old: str, new: str, image: str, meta: events.Meta
) -> list[events.SessionEvent]:
    """Replace the session's sandbox ``old`` by ``new`` in one append (re-provisioning)."""
    if state is None or state.status != "active" or state.sandbox_id != old:
        return []
    return [
        events.SessionSandboxReleased(meta=meta, session_id=state.session_id, sandbox_id=old),
        events.SessionSandboxAssigned(meta=meta, session_id=state.session_id, sandbox_id=new, image=image),
    ]


def decide_install(
    state: states.SessionState | None, new: str, image: str, meta: events.Meta
) -> list[events.SessionEvent]:
    """``create_sandbox``'s sandbox ``new`` becomes the session's, whatever it has now: a
    sandbox assigned meanwhile (claimed at connect, or by a concurrent first call) is
    released in the same append, never adopted in place of what was asked for."""
    if state is None or state.status != "active":
        return []
    if state.sandbox_id == new:
        return []
    if state.sandbox_id is None:
        return decide_assign(state, new, image, meta)
    return decide_swap(state, state.sandbox_id, new, image, meta)


def released(appended: Sequence[events.Event]) -> list[str]:
    """The sandboxes an append released (to delete once it is written)."""
    return [e.sandbox_id for e in appended if isinstance(e, events.SessionSandboxReleased)]


def decide_release(
    state: states.SessionState | None, sandbox_id: str, meta: events.Meta
) -> list[events.SessionEvent]:
    if state is None or state.sandbox_id != sandbox_id:
        return []
    return [events.SessionSandboxReleased(meta=meta, session_id=state.session_id, sandbox_id=sandbox_id)]


class SandboxOptions(TypedDict, total=False):
    """What a session's sandbox is provisioned with (``image`` always)."""

    image: Required[str]
    use_kata: bool
    run_as_root: bool
    writable_root: bool
    snapshot: str
    """Start from this snapshot (from its own pool if it is kept warm, never a configured
    pool's: its files are below the sandbox's from the start)."""


def snapshot_options(snapshot: states.SnapshotState) -> SandboxOptions:
    """What a sandbox that starts from ``snapshot`` is provisioned with: what its sandbox had."""
    return {
        "image": snapshot.image,
        "run_as_root": snapshot.run_as_root,
        "writable_root": snapshot.writable_root,
        "snapshot": snapshot.snapshot_id,
    }


def sandbox_options(command: commands.SessionCommand, state: states.SessionState) -> SandboxOptions:
    """What to provision for a session: the command's options, else the session's image."""
    if isinstance(command, commands.ProvisionSandbox):
        return {
            "image": command.image or "default",
            "use_kata": command.use_kata,
            "run_as_root": command.run_as_root,
            "writable_root": command.writable_root,
        }
    return {"image": state.image or "default"}
