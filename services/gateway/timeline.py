"""``GET /v1/sessions/{id}/timeline``: what happened to a session and in its sandboxes, in
order (:mod:`shared.domain.timeline` says which events and what each entry holds).

A page (JSON :class:`~sbx_api.wire.Timeline`) reads only the session's subjects: its
own events, its audit records and the events of the sandboxes it had, from ``after``.
``follow=true`` answers a stream instead (NDJSON, or server-sent events on ``Accept:
text/event-stream``): the entries there are, then each new one as it is appended; a
sandbox the session gets meanwhile joins. Deleted sessions keep their timelines (audit).
A session id deleted and created again has one history per incarnation: a key bound to an
organisation sees only the incarnations its organisation created (none: 404, as for an id
that never was), the operator's key every one, each entry with its ``incarnation``.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute

from sbx_api import errors
from sbx_api import hostapi as contract
from sbx_api.wire import TIMELINE_KINDS, Timeline, TimelineEntry, TimelineKind
from services.gateway import hostapi, media, rest, schemas
from shared.contract import ids, subjects
from shared.domain import timeline as rules
from shared.infrastructure import eventstore
from shared.infrastructure import timeline as reading

LIMIT_DEFAULT = 100
LIMIT_MAX = 1000
KEEPALIVE_NDJSON = b"\n"
"""An empty line: NDJSON readers skip it; proxies see the stream is alive."""
KEEPALIVE_SSE = b": keepalive\n\n"
_PARAMS = frozenset(("kind", "after", "limit", "follow"))
_encoder = msgspec.json.Encoder()

OPERATIONS: tuple[rest.Operation, ...] = (
    rest.Operation(
        "GET",
        "/v1/sessions/{session_id}/timeline",
        "getTimeline",
        "A session's timeline: lifecycle, commands, edits, egress in order (paged, or followed as a stream)",
        "timeline",
        {
            200: (
                Timeline,
                "A page (JSON); with follow=true, a stream of TimelineEntry (NDJSON lines, or server-sent "
                "events named 'entry'), empty lines or comments as keepalives.",
            ),
            400: (schemas.Problem, "Invalid input."),
            401: (schemas.Problem, "Missing or wrong API key."),
            404: (
                schemas.Problem,
                "No such session, ever (or only other organisations' incarnations of it).",
            ),
            406: (schemas.Problem, "The Accept header admits none of the answer's media types."),
            503: (schemas.Problem, "NATS is unavailable; retry."),
        },
        params=(
            rest.SESSION_ID_PARAM,
            rest.Param(
                "kind",
                "query",
                "Only entries of this kind (repeat for more); none: all.",
                {"type": "array", "items": {"type": "string", "enum": list(TIMELINE_KINDS)}},
            ),
            rest.Param(
                "after",
                "query",
                "Only entries after this seq (a page's next_after); default 0: from the start.",
                {"type": "integer", "minimum": 0, "maximum": 2**63 - 1},
            ),
            rest.Param(
                "limit",
                "query",
                f"At most this many entries in a page (default {LIMIT_DEFAULT}).",
                {"type": "integer", "minimum": 1, "maximum": LIMIT_MAX},
            ),
            rest.Param(
                "follow",
                "query",
                "Stream the entries, then new ones as they come, until the client leaves.",
                {"type": "boolean", "default": False},
            ),
        ),
        answer_media=(
            ("application/json", Timeline),
            (contract.NDJSON, TimelineEntry),
            (contract.EVENT_STREAM, TimelineEntry),
        ),
    ),
)


class Query(msgspec.Struct, frozen=True):
    session_id: str
    kinds: frozenset[TimelineKind]
    after: int
    limit: int
    follow: bool


def parse(request: Request) -> Query:
    """The query, checked whole before anything is read."""
    query = request.query_params
    unknown = sorted(set(query) - _PARAMS)
    if unknown:
        raise errors.InvalidInput(
            f"unknown query parameter {unknown[0]!r}; known: {', '.join(sorted(_PARAMS))}"
        )
    for name in ("after", "limit", "follow"):
        if len(query.getlist(name)) > 1:
            raise errors.InvalidInput(f"give {name} once")
    after = query.get("after", "0")
    if not after.isdigit() or int(after) >= 2**63:
        raise errors.InvalidInput("after must be a sequence number (an integer from 0)")
    limit = query.get("limit", str(LIMIT_DEFAULT))
    if not limit.isdigit() or not 1 <= int(limit) <= LIMIT_MAX:
        raise errors.InvalidInput(f"limit must be an integer from 1 to {LIMIT_MAX}")
    follow = query.get("follow", "false")
    if follow not in ("true", "false"):
        raise errors.InvalidInput("follow must be true or false")
    return Query(
        session_id=ids.validate_session_id(request.path_params["session_id"]),
        kinds=rules.kinds(query.getlist("kind")),
        after=int(after),
        limit=int(limit),
        follow=follow == "true",
    )


class TimelineAPI:
    def __init__(self, store: eventstore.EventStore, topology: subjects.Topology) -> None:
        self.reader = reading.TimelineReader(store, topology)

    def routes(self) -> list[BaseRoute]:
        return rest.routes(self, OPERATIONS)

    async def timeline(self, request: Request) -> Response:
        query = parse(request)
        offers = (contract.NDJSON, contract.EVENT_STREAM) if query.follow else ("application/json",)
        media_type = media.negotiate(request.headers.get("accept"), offers)
        members = await self.reader.members(query.session_id, request.scope.get("sbx.org"))
        if not members.lives.seen_by(members.viewer):
            raise errors.NotFound(f"session {query.session_id!r} does not exist")
        if not query.follow:
            page = await self.reader.page(members, query.kinds, after=query.after, limit=query.limit)
            return rest.json_response(page)
        entries = self.reader.follow(members, query.kinds, after=query.after)
        return hostapi.LiveStream(
            _encoded(hostapi.with_keepalives(_framed(entries), None), media_type), {}, media_type
        )


async def _framed(entries: AsyncIterator[TimelineEntry]) -> AsyncGenerator[TimelineEntry | None, None]:
    async for entry in entries:
        yield entry


async def _encoded(
    items: AsyncIterator[TimelineEntry | None], media_type: str
) -> AsyncGenerator[bytes, None]:
    """Entries in the media type; ``None`` (a keepalive) as an empty line or a comment."""
    async for item in items:
        if item is None:
            yield KEEPALIVE_SSE if media_type == contract.EVENT_STREAM else KEEPALIVE_NDJSON
        elif media_type == contract.EVENT_STREAM:
            yield b"event: entry\nid: %d\ndata: %s\n\n" % (item.seq, _encoder.encode(item))
        else:
            yield _encoder.encode(item) + b"\n"
