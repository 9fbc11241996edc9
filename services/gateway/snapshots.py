"""Snapshots, forks and restores over REST: ``/v1/sessions/{id}/snapshots``,
``/v1/snapshots``, ``/v1/snapshots/{id}/forks``, ``/v1/sessions/{id}/restore``.

Each write is a scheduler command (``session.snapshot``, ``session.fork``,
``session.restore``, ``snapshot.delete``); reads come from the snapshots projection. A key
bound to an organisation sees, forks and restores only its organisation's snapshots.

Snapshot ids are one namespace for every organisation, so a key bound to one never
chooses an id (docs/snapshots.md, "Ids"): the gateway makes one up, at random or from the
Idempotency-Key with the organisation and the session, and another organisation's
snapshot answers exactly as a missing one does, for every read and write.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute

from sbx_api import errors
from sbx_api.wire import ForkFailure, Forks, Snapshot, SnapshotList
from services.gateway import rest, schemas
from shared.contract import commands, ids, states
from shared.domain import listing, pools
from shared.domain import snapshot as snapshot_rules
from shared.infrastructure import listings, rpc

FORKS_MAX = 100
"""Most sessions one fork request makes."""
BUDGET = rpc.PROVISION_TIMEOUT
"""How long a snapshot (a copy, as long as the files are big), a fork or a restore (a new
sandbox, its image maybe pulled) may take: the requests' own budget, not the gateway's
short one for ordinary commands; a scheduler that dies is still noticed in seconds."""
LIST_LIMIT_MAX = 1000

CHOSEN_ID_REFUSED = (
    "a key bound to an organisation cannot choose a snapshot id (ids are shared by every "
    "organisation): leave snapshot_id out, and send an Idempotency-Key to make a retry safe"
)

SNAPSHOT_ID_PARAM = rest.Param(
    "snapshot_id", "path", "The snapshot id.", rest.SESSION_ID_SCHEMA, required=True
)


class CreateSnapshotRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Optional: the snapshot's id (default: a new one, or one derived from the Idempotency-Key).
    Only the operator's key chooses one: a key bound to an organisation is refused it."""

    snapshot_id: schemas.SessionId | None = None


class ForkRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Either ``count`` new sessions with ids made up, or the ``session_ids`` to create."""

    JSON_SCHEMA_EXTRA: ClassVar[dict[str, Any]] = {
        "oneOf": [{"required": ["count"]}, {"required": ["session_ids"]}]
    }
    count: Annotated[float, msgspec.Meta(ge=1, le=FORKS_MAX, multiple_of=1)] | msgspec.UnsetType = (
        msgspec.UNSET
    )
    """A whole number (JSON does not tell 2 from 2.0; both are taken)."""
    session_ids: (
        Annotated[
            list[schemas.SessionId],
            msgspec.Meta(min_length=1, max_length=FORKS_MAX, extra_json_schema={"uniqueItems": True}),
        ]
        | msgspec.UnsetType
    ) = msgspec.UNSET


class WarmRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How many idle sandboxes started from the snapshot to keep ready (0: none)."""

    count: Annotated[float, msgspec.Meta(ge=0, le=snapshot_rules.WARM_MAX, multiple_of=1)]
    """A whole number (JSON does not tell 2 from 2.0; both are taken)."""


class RestoreRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    snapshot_id: schemas.SessionId


def snapshot_of(state: states.SnapshotState, ready: Mapping[str, int] | None = None) -> Snapshot:
    """The API's view of a snapshot; ``ready``: idle sandboxes ready per pool id."""
    warm_ready = (ready or {}).get(pools.PoolSpec.of_snapshot(state).pool_id, 0) if state.warm else 0
    return Snapshot(
        snapshot_id=state.snapshot_id,
        status=state.status,
        session_id=state.session_id,
        org_id=state.org_id,
        user_id=state.user_id,
        digest=state.digest,
        parent=state.parent,
        size=state.size,
        total_size=state.total_size,
        files=state.files,
        layers=len(state.layers),
        image=state.image,
        frozen_ms=state.frozen_ms,
        created_at=state.created_at,
        delete_reason=state.delete_reason,
        warm=state.warm,
        warm_ready=warm_ready,
    )


_SNAPSHOT_ERRORS: dict[int, tuple[type | None, str]] = {
    404: (schemas.Problem, "No such session or snapshot (or another organisation's)."),
    409: (
        schemas.Problem,
        "The session is stopped or has no sandbox yet, or the id (chosen by the operator) is taken; or "
        "another write won the race (code concurrency): retry.",
    ),
    429: (schemas.Problem, "The snapshot store's disk budget, or max_running for forks, is reached."),
    501: (schemas.Problem, "Snapshots are not available here (Kubernetes without SBX_K8S_SNAPSHOT_CLASS)."),
    **rest.COMMON_ERRORS,
}

OPERATIONS: tuple[rest.Operation, ...] = (
    rest.Operation(
        "POST",
        "/v1/sessions/{session_id}/snapshots",
        "createSnapshot",
        "Snapshot a session's files: processes frozen while they are copied, then thawed",
        "create_snapshot",
        {
            201: (Snapshot, "Taken (or taken before with the same id)."),
            **_SNAPSHOT_ERRORS,
            400: (
                schemas.Problem,
                "Invalid input, or a key bound to an organisation chose a snapshot id (only the "
                "operator's key may); nothing was changed.",
            ),
        },
        body=CreateSnapshotRequest,
        body_optional=True,
        params=(rest.SESSION_ID_PARAM, rest.IDEMPOTENCY),
        tag="snapshots",
        answer_headers=("Location",),
    ),
    rest.Operation(
        "GET",
        "/v1/snapshots",
        "listSnapshots",
        "List snapshots, oldest first (deleted ones only when asked for)",
        "list_snapshots",
        {200: (SnapshotList, "Matching snapshots."), **rest.COMMON_ERRORS},
        params=(
            rest.Param("session_id", "query", "Only snapshots of this session.", rest.SESSION_ID_SCHEMA),
            rest.Param(
                "status",
                "query",
                "Only snapshots in this status.",
                {"type": "string", "enum": list(listing.SNAPSHOT_STATUSES)},
            ),
            rest.Param(
                "limit",
                "query",
                "At most this many (default 100).",
                {"type": "integer", "minimum": 1, "maximum": LIST_LIMIT_MAX},
            ),
            rest.Param("cursor", "query", rest.CURSOR_HELP, rest.CURSOR_SCHEMA),
        ),
        tag="snapshots",
    ),
    rest.Operation(
        "GET",
        "/v1/snapshots/{snapshot_id}",
        "getSnapshot",
        "Get one snapshot",
        "get_snapshot",
        {
            200: (Snapshot, "The snapshot."),
            404: (schemas.Problem, "No such snapshot, or it was deleted (listed with status=deleted)."),
            **rest.COMMON_ERRORS,
        },
        params=(SNAPSHOT_ID_PARAM,),
        tag="snapshots",
    ),
    rest.Operation(
        "DELETE",
        "/v1/snapshots/{snapshot_id}",
        "deleteSnapshot",
        "Delete a snapshot (sessions forked or restored from it keep their files)",
        "delete_snapshot",
        {
            204: (None, "Deleted (or deleted before)."),
            404: (schemas.Problem, "No such snapshot."),
            **rest.COMMON_ERRORS,
        },
        params=(SNAPSHOT_ID_PARAM, rest.IDEMPOTENCY),
        tag="snapshots",
    ),
    rest.Operation(
        "POST",
        "/v1/snapshots/{snapshot_id}/forks",
        "forkSnapshot",
        f"Create 1 to {FORKS_MAX} sessions starting from a snapshot (its files shared read-only)",
        "fork_snapshot",
        {201: (Forks, "The sessions made (and those that could not be, each said why)."), **_SNAPSHOT_ERRORS},
        body=ForkRequest,
        params=(SNAPSHOT_ID_PARAM, rest.IDEMPOTENCY),
        tag="snapshots",
    ),
    rest.Operation(
        "PUT",
        "/v1/snapshots/{snapshot_id}/warm",
        "warmSnapshot",
        f"Keep 0 to {snapshot_rules.WARM_MAX} idle sandboxes started from a snapshot: its forks are claims",
        "warm_snapshot",
        {
            200: (Snapshot, "Set: the pool-manager starts (or removes) sandboxes to match; see warm_ready."),
            403: (schemas.Problem, "A snapshot of no organisation: only an operator keeps it warm."),
            404: (schemas.Problem, "No such snapshot (or another organisation's)."),
            429: (schemas.Problem, "The organisation would keep more than 100 warm across its snapshots."),
            **rest.CONCURRENCY,
            **rest.COMMON_ERRORS,
        },
        body=WarmRequest,
        params=(SNAPSHOT_ID_PARAM,),
        tag="snapshots",
    ),
    rest.Operation(
        "POST",
        "/v1/sessions/{session_id}/restore",
        "restoreSession",
        "Put a session back to a snapshot: a new sandbox from it replaces the session's (processes gone)",
        "restore_session",
        {
            200: (schemas.Session, "Restored: the session's next call runs in the snapshot's files."),
            **_SNAPSHOT_ERRORS,
        },
        body=RestoreRequest,
        params=(rest.SESSION_ID_PARAM, rest.IDEMPOTENCY),
        tag="snapshots",
    ),
)


class SnapshotsAPI:
    def __init__(self, sessions_api: rest.SessionsAPI, snapshots: Any, idle: Any, listed: Any) -> None:
        self.api = sessions_api
        self.listed: listings.Listing[states.SnapshotState] = listed
        """Snapshots in list indexes (a projection store of its own, followed)."""
        self.client = sessions_api.client
        self.snapshots = snapshots
        """projector.ProjectionStore[states.SnapshotState]"""
        self.idle = idle
        """projector.ProjectionStore[states.SandboxState] of its own: followed (ready pool
        sandboxes only) from the first time a snapshot kept warm is shown."""
        self._following = asyncio.Lock()

    async def _ready(self, *snapshots: states.SnapshotState) -> dict[str, int]:
        """Ready pool sandboxes per pool (only when a snapshot shown is kept warm)."""
        if not any(s.warm for s in snapshots):
            return {}
        async with self._following:
            await self.idle.follow(keep=pools.ready)  # (once: a no-op when followed)
        return dict(collections.Counter(s.pool for s in (await self.idle.all()).values()))

    async def close(self) -> None:
        await self.idle.unfollow()
        await self.listed.stop()

    @staticmethod
    def _snapshot_id(request: Request) -> str:
        return ids.validate_session_id(request.path_params["snapshot_id"], what="snapshot id")

    def _visible(
        self, request: Request, state: states.SnapshotState | None, snapshot_id: str, *, deleted: bool = False
    ) -> states.SnapshotState:
        """The snapshot the caller may see (a deleted one only if ``deleted``: a list asked
        for ``status=deleted`` shows those, as sessions' do)."""
        bound = request.scope.get("sbx.org")
        foreign = bound is not None and state is not None and state.org_id not in (None, bound)
        if state is None or foreign or (state.status == "deleted" and not deleted):
            raise errors.NotFound(f"snapshot {snapshot_id!r} does not exist")
        return state

    @staticmethod
    def _derived(request: Request, what: str, org: str | None, scope: str) -> str:
        """An id that a retry with the same Idempotency-Key gets again; else a new one. The
        key is the caller's: the organisation and ``scope`` (the session, the snapshot) are
        in the digest, so the same key used by two organisations never names one id."""
        key = request.headers.get("idempotency-key")
        if key is None:
            return ids.new_id()[:20]
        return hashlib.sha256(msgspec.json.encode([what, org, scope, key])).hexdigest()[:20]

    async def _optional_body(self, request: Request, body_type: type[Any]) -> Any:
        if not await request.body():
            return body_type()
        return await self.api.read_body(request, body_type)

    async def create_snapshot(self, request: Request) -> Response:
        body: CreateSnapshotRequest = await self._optional_body(request, CreateSnapshotRequest)
        if body.snapshot_id is not None and request.scope.get("sbx.org") is not None:
            raise errors.InvalidInput(CHOSEN_ID_REFUSED)
        session_id = self.api.path_session_id(request)
        fields = self.api.command_fields(request, "snapshot")
        snapshot_id = body.snapshot_id or (
            f"snap-{self._derived(request, 'snapshot', fields['actor'].org_id, session_id)}"
        )
        command = commands.SnapshotSession(
            session_id=session_id,
            snapshot_id=ids.validate_session_id(snapshot_id, what="snapshot id"),
            **fields,
        )
        reply = await self.client.call(command, timeout=BUDGET)
        assert reply.snapshot is not None
        return rest.json_response(
            snapshot_of(reply.snapshot), 201, location=f"/v1/snapshots/{reply.snapshot.snapshot_id}"
        )

    async def list_snapshots(self, request: Request) -> Response:
        query = request.query_params
        status, session_id = query.get("status"), query.get("session_id")
        if status is not None and status not in listing.SNAPSHOT_STATUSES:
            raise errors.InvalidInput(f"status must be one of: {', '.join(listing.SNAPSHOT_STATUSES)}")
        if session_id is not None:
            ids.validate_session_id(session_id)
        limit = rest.list_limit(query.get("limit"))
        selector = listing.snapshot_selector(status, request.scope.get("sbx.org"), session_id)
        raw_cursor = query.get("cursor")
        cursors = self.api.cursors
        after = cursors.decode("snapshots", selector, raw_cursor) if raw_cursor is not None else None
        page = await self.listed.page(selector, after=after, limit=limit)
        ready = await self._ready(*page.items)
        return rest.json_response(
            SnapshotList(
                snapshots=[snapshot_of(s, ready) for s in page.items],
                count=page.total,
                next_cursor=cursors.encode("snapshots", selector, page.last) if page.last else None,
            )
        )

    async def get_snapshot(self, request: Request) -> Response:
        snapshot_id = self._snapshot_id(request)
        state = self._visible(request, await self.snapshots.get(snapshot_id), snapshot_id)
        return rest.json_response(snapshot_of(state, await self._ready(state)))

    async def warm_snapshot(self, request: Request) -> Response:
        snapshot_id = self._snapshot_id(request)
        body: WarmRequest = await self.api.read_body(request, WarmRequest)
        state = self._visible(request, await self.snapshots.get(snapshot_id), snapshot_id)
        reply = await self.client.call(
            commands.WarmSnapshot(
                session_id=state.session_id,
                snapshot_id=snapshot_id,
                count=int(body.count),
                **self.api.command_fields(request, "warm"),
            )
        )
        assert reply.snapshot is not None
        return rest.json_response(snapshot_of(reply.snapshot, await self._ready(reply.snapshot)))

    async def delete_snapshot(self, request: Request) -> Response:
        snapshot_id = self._snapshot_id(request)
        state = self._visible(request, await self.snapshots.get(snapshot_id), snapshot_id, deleted=True)
        await self.client.call(
            commands.DeleteSnapshot(
                session_id=state.session_id,
                snapshot_id=snapshot_id,
                **self.api.command_fields(request, "unsnap"),
            )
        )
        return rest.json_response(None, 204)

    async def fork_snapshot(self, request: Request) -> Response:
        snapshot_id = self._snapshot_id(request)
        body: ForkRequest = await self.api.read_body(request, ForkRequest)
        fields = self.api.command_fields(request, "fork")
        if (body.count is msgspec.UNSET) == (body.session_ids is msgspec.UNSET):
            raise errors.InvalidInput("give either count or session_ids")
        if body.session_ids is not msgspec.UNSET:
            wanted = [ids.validate_session_id(s) for s in body.session_ids]
            if len(set(wanted)) != len(wanted):
                raise errors.InvalidInput("session_ids has the same id twice")
        else:
            assert body.count is not msgspec.UNSET
            derived = self._derived(request, "fork", fields["actor"].org_id, snapshot_id)
            stem = f"{snapshot_id[:90]}-{derived[:8]}"
            wanted = [f"{stem}-{n}" for n in range(1, int(body.count) + 1)]
        self._visible(request, await self.snapshots.get(snapshot_id), snapshot_id)
        forks = [
            commands.ForkSession(
                session_id=session_id,
                snapshot_id=snapshot_id,
                **{**fields, "command_id": f"{fields['command_id']}:{session_id}"},
            )
            for session_id in wanted
        ]
        results = await asyncio.gather(
            *(self.client.call(f, timeout=BUDGET) for f in forks), return_exceptions=True
        )
        made, failed = [], []
        for fork, result in zip(forks, results, strict=True):
            if isinstance(result, errors.SandboxError):
                failed.append(
                    ForkFailure(session_id=fork.session_id, error=result.code, message=result.message)
                )
            elif isinstance(result, BaseException):
                raise result
            elif result.session is not None:
                made.append(schemas.session_of(result.session))
        if not made:  # nothing made: the first reason, as the answer's status
            first = next(r for r in results if isinstance(r, errors.SandboxError))
            raise first
        return rest.json_response(Forks(snapshot_id=snapshot_id, sessions=made, failed=failed), 201)

    async def restore_session(self, request: Request) -> Response:
        body: RestoreRequest = await self.api.read_body(request, RestoreRequest)
        command = commands.RestoreSession(
            session_id=self.api.path_session_id(request),
            snapshot_id=ids.validate_session_id(body.snapshot_id, what="snapshot id"),
            **self.api.command_fields(request, "restore"),
        )
        state = (await self.client.call(command, timeout=BUDGET)).session
        self.api.forget_placement(command.session_id)
        assert state is not None
        return rest.json_response(schemas.session_of(state))

    def routes(self) -> list[BaseRoute]:
        return rest.routes(self, OPERATIONS)
