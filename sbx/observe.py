"""``sbx status``, ``sbx events`` and ``sbx replay``: reading a stack through NATS."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections import Counter
from datetime import UTC, datetime
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.js.client import JetStreamContext
from nats.js.errors import NotFoundError

from sbx import bars, stack
from sbx_api import errors
from sbx_api.wire import TimelineEntry
from sbx_client import terminal
from shared.contract import codec, events, ids, subjects
from shared.domain import checkpoints, describe, projections
from shared.domain import timeline as timeline_rules
from shared.infrastructure import bus, eventstore, health, projector, replay
from shared.infrastructure.settings import bus as bus_settings

CONNECT_WAIT = 5.0
"""How long a command waits for NATS to answer before it gives up (exit 75)."""


async def connect_bus(
    bus_settings: bus_settings.BusSettings, who: str = "sbx-cli", wait: float = CONNECT_WAIT
) -> Client:
    """Connected, or Unavailable after ``wait`` seconds: the client itself would retry a
    first connect for ever (nats-py 2.16 with unlimited reconnects), which a service
    starting before NATS wants and a command does not."""
    try:
        async with asyncio.timeout(wait):
            return await bus.connect(bus_settings, who, connect_timeout=min(3.0, wait))
    except TimeoutError:
        raise errors.Unavailable(
            f"cannot connect to NATS at {bus_settings.nats_url}: no answer within {wait:.0f}s"
        ) from None


async def connect(bus_settings: bus_settings.BusSettings) -> tuple[Client, subjects.Topology]:
    return await connect_bus(bus_settings), subjects.Topology(bus_settings.namespace)


# ---- status -----------------------------------------------------------------


async def status(nc: Client, topology: subjects.Topology, *, as_json: bool, phase: str | None = None) -> int:
    """``phase``: what the local ``sbx up`` says it is doing (``starting``, ``up``,
    ``stopping``), if there is one."""
    js = nc.jetstream()
    try:
        reports = await health.read_all(js, topology.health_bucket)
    except Exception as exc:  # no bucket yet: nothing has started in this namespace
        print(terminal.escape(f"sbx: no health reports ({type(exc).__name__}: {exc})"), file=sys.stderr)
        reports = []
    store = eventstore.EventStore(js, topology)
    sessions = await _all(js, projections.SESSIONS, store)
    sandboxes = await _all(js, projections.SANDBOXES, store)
    sandbox_counts = Counter(s.status for s in sandboxes.values())
    idle = sum(1 for s in sandboxes.values() if s.pool and s.session_id is None and s.status == "running")
    now = datetime.now(UTC)
    instances: list[dict[str, Any]] = [
        {
            "service": r.service,
            "instance": r.instance,
            "pid": r.pid,
            "host": r.host,
            "status": health.liveness(r, now),
            "version": r.version,
            "since": r.started_at.isoformat(),
            "last_report_age_s": round((now - r.reported_at).total_seconds(), 1),
            "details": r.details,
        }
        for r in reports
    ]
    expected = [stack.service_name(m) for m in stack.SERVICES]
    live = {i["service"] for i in instances if i["status"] == "ok"}
    missing = [s for s in expected if s not in live]
    counts = Counter(s.status for s in sessions.values())
    if as_json:
        print(
            terminal.json_text(
                {
                    "phase": phase,
                    "services": instances,
                    "missing": missing,
                    "sessions": dict(counts),
                    "sandboxes": dict(sandbox_counts),
                    "pool_idle": idle,
                },
                indent=2,
            )
        )
    else:
        if phase and phase != "up":
            print(f"stack: {phase}" + (" (services are coming up)" if phase == "starting" else ""))
        print(f"{'SERVICE':14} {'INSTANCE':28} {'PID':>7} {'STATUS':9} {'REPORT':>7}  DETAILS")
        for i in instances:
            details = " ".join(f"{k}={v}" for k, v in i["details"].items())
            print(
                terminal.escape(
                    f"{i['service']:14} {i['instance']:28} {i['pid']:>7} {i['status']:9} "
                    f"{i['last_report_age_s']:>6}s  {details}"
                )
            )
        for name in missing:
            print(f"{name:14} {'-':28} {'-':>7} {'down':9}")
        print("\nsessions: " + (", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "none"))
        print(
            "sandboxes: "
            + (", ".join(f"{n} {k}" for k, n in sorted(sandbox_counts.items())) or "none")
            + f" (warm pool: {idle} idle)"
        )
    return 1 if missing else 0


async def _all(js: JetStreamContext, projection: Any, store: eventstore.EventStore) -> dict[str, Any]:
    """Every entry of a projection; none if its bucket was never made (nothing has
    started in this namespace yet)."""
    try:
        return await (await projector.ProjectionStore.open(js, projection, store)).all()
    except NotFoundError:
        return {}


# ---- events -----------------------------------------------------------------


def event_record(stored: eventstore.Stored) -> dict[str, Any]:
    return {"seq": stored.seq, "subject": stored.subject, "event": codec.to_builtins(stored.event)}


async def follow_events(
    nc: Client,
    topology: subjects.Topology,
    *,
    session: str | None,
    follow: bool,
    as_json: bool,
    since: int,
) -> int:
    store = eventstore.EventStore(nc.jetstream(), topology)
    subject = None
    members = None
    if session is not None:
        # The session's own events, the audit records of what it did, and its sandboxes'
        # and snapshots' events (those are named by their own ids: read all, the session's
        # kept, as the timeline does).
        members = timeline_rules.Membership(ids.validate_session_id(session))
        subject = [
            topology.aggregate_subject(subjects.SESSION, members.session_id),
            topology.aggregate_subject(subjects.EXEC, members.session_id),
            topology.aggregate_subject(subjects.EGRESS, members.session_id),
            topology.events_of_kind(subjects.SANDBOX),
            topology.events_of_kind(subjects.SNAPSHOT),
        ]
        if since:  # its sandboxes, learnt from the events --since skips
            async for stored in store.read(subject[0]):
                members.learn(stored.seq, stored.event)
    # Closed here, while NATS is still connected, whatever stops the loop (a closed pipe,
    # Ctrl-C): left to the event loop's shutdown it would fail and print a traceback.
    async with contextlib.aclosing(store.read(subject, start_seq=since, follow=follow)) as stream:
        async for stored in stream:
            if members is not None:
                members.learn(stored.seq, stored.event)
                if not members.owns(stored.seq, stored.event):
                    continue
            print(terminal.json_line(event_record(stored)) if as_json else _line(stored), flush=True)
    return 0


def _line(stored: eventstore.Stored) -> str:
    """One event for people: its fields are what sandboxes and tenants wrote, escaped."""
    meta = stored.event.meta
    who = " ".join(f"{k}={v}" for k, v in (("org", meta.org_id), ("user", meta.user_id)) if v)
    return terminal.escape(
        f"{stored.seq:>8} {meta.time.isoformat(timespec='milliseconds')} "
        f"{events.tag_of(type(stored.event)):18} {describe.line(stored.event)}  "
        f"[{meta.service}/{meta.instance}{' ' + who if who else ''}]"
    )


# ---- a session's timeline ------------------------------------------------------


async def show_timeline(
    nc: Client,
    topology: subjects.Topology,
    *,
    session: str,
    kinds: list[str],
    after: int,
    limit: int | None,
    follow: bool,
    as_json: bool,
) -> int:
    """Print a session's timeline (every page, or at most ``limit`` entries), then follow it."""
    from shared.domain import timeline as rules
    from shared.infrastructure import timeline

    session = ids.validate_session_id(session)
    wanted = rules.kinds(kinds)
    reader = timeline.TimelineReader(eventstore.EventStore(nc.jetstream(), topology), topology)
    members = await reader.members(session)  # the operator's view: every incarnation
    shown, life = 0, _Life(as_json)
    if not follow:
        while limit is None or shown < limit:
            page = await reader.page(members, wanted, after=after, limit=min(1000, (limit or 1000) - shown))
            if not page.entries and not after and not await _session_known(nc, topology, session):
                raise errors.NotFound(f"session {session!r} has no events: no such session")
            for entry in page.entries:
                life.mark(entry)
                print(_timeline_line(entry, as_json), flush=True)
            shown += len(page.entries)
            after = page.next_after
            if not page.more:
                break
        return 0
    async with contextlib.aclosing(reader.follow(members, wanted, after=after)) as entries:
        async for entry in entries:
            life.mark(entry)
            print(_timeline_line(entry, as_json), flush=True)
    return 0


class _Life:
    """A line before the first entry of each incarnation of a re-created id (text only: in
    JSON each entry carries its ``incarnation``)."""

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json
        self.current: int | None = None

    def mark(self, entry: TimelineEntry) -> None:
        if self.as_json or entry.incarnation is None or entry.incarnation == self.current:
            return
        if self.current is not None or entry.incarnation > 1:
            print(f"-- incarnation {entry.incarnation} --", flush=True)
        self.current = entry.incarnation


async def _session_known(nc: Client, topology: subjects.Topology, session: str) -> bool:
    store = eventstore.EventStore(nc.jetstream(), topology)
    async with contextlib.aclosing(
        store.read(topology.aggregate_subject(subjects.SESSION, session))
    ) as stream:
        async for _ in stream:
            return True
    return False


def _timeline_line(entry: TimelineEntry, as_json: bool) -> str:
    if as_json:
        return terminal.json_line(msgspec.to_builtins(entry))
    who = " ".join(f"{k}={v}" for k, v in (("user", entry.user_id), ("request", entry.request_id)) if v)
    took = f" {entry.duration_ms} ms" if entry.duration_ms is not None and entry.kind != "lifecycle" else ""
    return terminal.escape(
        f"{entry.seq:>8} {entry.time.isoformat(timespec='milliseconds')} {entry.kind:9} "
        f"{entry.summary}{took}{'  [' + who + ']' if who else ''}"
    )


# ---- replay -----------------------------------------------------------------


async def replay_projections(
    nc: Client, topology: subjects.Topology, *, mode: str, full: bool, as_json: bool
) -> int:
    js = nc.jetstream()
    rebuild = mode == "rebuild"
    try:
        with bars.counting("folding events", "events", shown=bars.wanted(as_json=as_json)) as progress:
            if mode == "checkpoint":
                report = await replay.take_checkpoint(js, topology, progress=progress)
            elif rebuild:
                report = await replay.rebuild(js, topology, progress=progress, full=full)
            else:
                report = await replay.verify(js, topology, progress=progress, full=full)
    except checkpoints.HistoryGone as exc:
        print(terminal.escape(f"cannot replay: {exc}"), file=sys.stderr)
        return 1
    if as_json:
        print(
            terminal.json_text(
                {
                    "from_seq": report.from_seq,
                    "events": report.events,
                    "seconds": round(report.seconds, 3),
                    "aggregates": report.aggregates,
                    "differences": [codec.to_builtins(d.__dict__) for d in report.differences],
                    "rebuilt": rebuild,
                },
                indent=2,
            )
        )
    else:
        sizes = ", ".join(f"{n} {k}s" for k, n in report.aggregates.items())
        start = f"checkpoint at {report.from_seq}" if report.from_seq else "the first event"
        print(
            f"replayed {report.events} events from {start} into {sizes} "
            f"in {report.seconds:.2f}s ({report.rate:,.0f} events/s)"
        )
        if mode == "checkpoint":
            print("checkpoint stored" if report.events or not report.from_seq else "no new events: kept")
            return 0
        for difference in report.differences:
            print(terminal.escape(("rewrote " if rebuild else "DIFFERS ") + difference.describe()))
        if not report.differences:
            print("projections match the event stream")
        elif rebuild:
            print(f"rewrote {len(report.differences)} entries from the stream")
        else:
            print(f"{len(report.differences)} projection entries differ from the stream", file=sys.stderr)
    return 0 if rebuild or not report.differences else 1


async def set_replicas(nc: Client, topology: subjects.Topology, *, copies: int, as_json: bool) -> int:
    before = await bus.set_replicas(nc.jetstream(), topology, copies)
    if as_json:
        print(terminal.json_line({"replicas": copies, "before": before}))
    else:
        for name, count in before.items():
            print(f"{name:40} {count} -> {copies}" if count != copies else f"{name:40} {copies} (unchanged)")
    return 0
