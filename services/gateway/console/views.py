"""What the console's pages show, computed from states and events (pure: no I/O).

Each function turns what the routes read (projection states, events, health reports,
a replay report) into rows of plain text for the templates; who may see what (an
organisation-bound key sees only its organisation) is decided here too, so it is tested
without a server.
"""

from __future__ import annotations

import collections
import re
import urllib.parse
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import msgspec

from sbx_api import errors
from sbx_api.wire import TimelineEntry
from shared.contract import events, ids, states
from shared.domain import describe
from shared.infrastructure import health

STATUSES: tuple[str, ...] = states.SESSION_STATUSES
SANDBOX_STATUSES: tuple[str, ...] = states.SANDBOX_STATUSES
FILTER_MAX = 128
SUMMARY_MAX = 300
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/@\s]*@")


@dataclass(frozen=True)
class Nav:
    """The navigation of a logged-in page: who it is and their logout form."""

    user: str
    scope: str
    operator: bool
    """The operator's key: the System page is theirs."""
    csrf: str


def redact(text: str) -> str:
    """Free text with the user and password of any URL in it replaced (``scheme://…@host``):
    what services report and events hold is shown, credentials that slipped in are not."""
    return _USERINFO.sub(r"\1…@", text)


# ---- sessions ---------------------------------------------------------------------


@dataclass(frozen=True)
class Filters:
    status: str = ""
    org: str = ""
    user: str = ""
    image: str = ""

    def admits(self, status: str, org: str | None, user: str | None, image: str) -> bool:
        """Whether a row with these values is listed: its status (deleted ones only when
        asked for), organisation and user exactly, the image by a part of its name."""
        if (status != self.status) if self.status else status == "deleted":
            return False
        if (self.org and (org or "") != self.org) or (self.user and (user or "") != self.user):
            return False
        return not self.image or self.image in image

    def query(self) -> str:
        """As a query string (the filters form's own values), empty fields left out."""
        pairs = [(k, getattr(self, k)) for k in ("status", "org", "user", "image")]
        return urllib.parse.urlencode([(k, v) for k, v in pairs if v])


def filters(query: Mapping[str, str], bound: str | None, statuses: Sequence[str] = STATUSES) -> Filters:
    """A list's filters from a query string; InvalidInput for a status not in ``statuses``
    or text that is too long. A key bound to an organisation lists only that one: asking
    for another is Forbidden."""
    status = query.get("status", "")
    if status not in ("", *statuses):
        raise errors.InvalidInput(f"status must be one of: {', '.join(statuses)}")
    texts = {}
    for name in ("org", "user", "image"):
        value = query.get(name, "").strip()
        if len(value) > FILTER_MAX or not value.isprintable():
            raise errors.InvalidInput(f"the {name} filter must be printable text of at most {FILTER_MAX}")
        texts[name] = value
    if bound is not None:
        if texts["org"] not in ("", bound):
            raise errors.Forbidden("this key acts for one organisation: it lists only that organisation's")
        texts["org"] = bound
    return Filters(status=status, **texts)


@dataclass(frozen=True)
class Option:
    value: str
    label: str
    selected: bool


@dataclass(frozen=True)
class FilterForm:
    """A list's filters form: where it goes, its status choices and its fields' values."""

    action: str
    what: str
    options: list[Option]
    chosen: Filters
    org_readonly: bool
    """A key bound to an organisation cannot change the organisation filter."""


def filter_form(
    what: str, chosen: Filters, statuses: Sequence[str], any_status: str, bound: str | None
) -> FilterForm:
    """The filters form of the list ``what`` (``any_status``: what no status chosen lists)."""
    return FilterForm(
        action=href(what),
        what=what,
        options=[Option(v, v or any_status, v == chosen.status) for v in ("", *statuses)],
        chosen=chosen,
        org_readonly=bound is not None,
    )


@dataclass(frozen=True)
class SessionRow:
    session_id: str
    href: str
    status: str
    org: str
    user: str
    image: str
    sandbox_id: str
    sandbox_status: str
    created: str
    updated: str


def href(*segments: str) -> str:
    """A console URL, each segment quoted (ids are checked elsewhere; this never trusts them)."""
    return "/console/" + "/".join(urllib.parse.quote(s, safe="") for s in segments)


def when(moment: datetime | None) -> str:
    """A time as every page shows it (seconds, UTC; the script writes live rows alike)."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ") if moment is not None else ""


def visible_session(state: states.SessionState | None, bound: str | None) -> bool:
    """Whether a console login may see a session: the operator sees all; a key bound to an
    organisation only that organisation's (not even sessions without one)."""
    return state is not None and (bound is None or state.org_id == bound)


def session_rows(
    sessions: Iterable[states.SessionState],
    sandboxes: Mapping[str, states.SandboxState],
    chosen: Filters,
    bound: str | None,
) -> list[SessionRow]:
    """The sessions the filters choose (deleted ones only when asked for), oldest first;
    ``sandboxes`` by sandbox id."""
    rows = []
    for s in sorted(sessions, key=lambda s: (s.created_at, s.session_id)):
        if not visible_session(s, bound):
            continue
        if not chosen.admits(s.status, s.org_id, s.user_id, s.image or "default"):
            continue
        box = sandboxes.get(s.sandbox_id) if s.sandbox_id else None
        rows.append(
            SessionRow(
                session_id=s.session_id,
                href=href("sessions", s.session_id),
                status=s.status,
                org=s.org_id or "",
                user=s.user_id or "",
                image=s.image or (box.image if box else "default"),
                sandbox_id=s.sandbox_id or "",
                sandbox_status=box.status if box else "",
                created=when(s.created_at),
                updated=when(s.updated_at),
            )
        )
    return rows


@dataclass(frozen=True)
class SandboxRow:
    sandbox_id: str
    status: str
    image: str
    backend: str
    pool: str
    session_id: str
    org: str
    user: str
    proxy: str
    created: str


def sandbox_rows(
    sandboxes: Iterable[states.SandboxState],
    sessions: Mapping[str, states.SessionState],
    chosen: Filters,
    bound: str | None,
) -> list[SandboxRow]:
    """The sandboxes the filters choose (deleted ones only when asked for), oldest first;
    organisation and user are those of the session it serves (``sessions`` by id). A key
    bound to an organisation sees only its sessions' sandboxes (not idle pool ones)."""
    rows = []
    for b in sorted(sandboxes, key=lambda b: (b.created_at, b.sandbox_id)):
        owner = sessions.get(b.session_id) if b.session_id else None
        org, user = (owner.org_id or "", owner.user_id or "") if owner else ("", "")
        if bound is not None and (owner is None or owner.org_id != bound):
            continue
        if not chosen.admits(b.status, org, user, b.image):
            continue
        rows.append(
            SandboxRow(
                sandbox_id=b.sandbox_id,
                status=b.status,
                image=b.image,
                backend=b.backend,
                pool=b.pool or "",
                session_id=b.session_id or "",
                org=org,
                user=user,
                proxy=b.proxy_id or "",
                created=when(b.created_at),
            )
        )
    return rows


# ---- snapshots ----------------------------------------------------------------------

SNAPSHOT_STATUSES: tuple[str, ...] = states.SNAPSHOT_STATUSES


@dataclass(frozen=True)
class SnapshotRow:
    snapshot_id: str
    status: str
    session_id: str
    org: str
    user: str
    image: str
    size: str
    total: str
    layers: str
    parent: str
    frozen: str
    created: str
    warm: str
    """Idle sandboxes kept started from it ("" for none)."""


def snapshot_rows(
    snapshots: Iterable[states.SnapshotState],
    chosen: Filters,
    bound: str | None,
    session_id: str | None = None,
) -> list[SnapshotRow]:
    """The snapshots the filters choose (deleted ones only when asked for), oldest first;
    only ``session_id``'s if given. A key bound to an organisation sees only its own."""
    rows = []
    for s in sorted(snapshots, key=lambda s: (s.created_at, s.snapshot_id)):
        if (bound is not None and s.org_id != bound) or (session_id and s.session_id != session_id):
            continue
        if not chosen.admits(s.status, s.org_id, s.user_id, s.image):
            continue
        rows.append(
            SnapshotRow(
                snapshot_id=s.snapshot_id,
                status=s.status + (f" ({s.delete_reason})" if s.delete_reason else ""),
                session_id=s.session_id,
                org=s.org_id or "",
                user=s.user_id or "",
                image=s.image,
                size=describe.size(s.size),
                total=describe.size(s.total_size),
                layers=str(len(s.layers)),
                parent=s.parent or "",
                frozen=f"{s.frozen_ms:.1f} ms",
                created=when(s.created_at),
                warm=str(s.warm) if s.warm else "",
            )
        )
    return rows


def session_details(state: states.SessionState) -> list[tuple[str, str]]:
    return [
        ("Session", state.session_id),
        ("Status", state.status),
        ("Organisation", state.org_id or "(none)"),
        ("User", state.user_id or "(none)"),
        ("Image", state.image or "default"),
        ("Created", when(state.created_at)),
        ("Updated", when(state.updated_at)),
        ("Incarnation", str(state.incarnation)),
        ("Forked from", state.forked_from or "(not a fork)"),
        ("Last event", str(state.last_seq)),
    ]


@dataclass(frozen=True)
class Actions:
    """The stop and delete forms of a session's page."""

    csrf: str
    stop: str
    delete: str
    can_stop: bool


def session_actions(state: states.SessionState, csrf: str) -> Actions | None:
    """What a session's page lets one do: stop it while active, delete it until deleted."""
    if state.status == "deleted":
        return None
    sid = state.session_id
    return Actions(
        csrf=csrf,
        stop=href("sessions", sid, "stop"),
        delete=href("sessions", sid, "delete"),
        can_stop=state.status == "active",
    )


def sandbox_details(box: states.SandboxState) -> list[tuple[str, str]]:
    return [
        ("Sandbox", box.sandbox_id),
        ("Status", box.status),
        ("Image", box.image + (f" ({box.image_digest})" if box.image_digest else "")),
        ("Backend", box.backend),
        ("Warm pool", box.pool or "(not from a pool)"),
        ("Started from", box.snapshot or "(its image)"),
        ("Runs as root", "yes" if box.run_as_root else "no"),
        ("Writable root", "yes" if box.writable_root else "no"),
        ("Proxy", box.proxy_id or "(none)"),
        ("Created", when(box.created_at)),
        ("Started", when(box.started_at)),
        ("Claimed", when(box.claimed_at)),
        ("Paused", when(box.paused_at)),
        ("Error", box.error or ""),
    ]


# ---- timelines and the audit stream -----------------------------------------------


def timeline_row(entry: TimelineEntry) -> dict[str, str]:
    """One timeline entry as the page shows it (the script builds the same cells from the
    JSON of a live entry: keep them alike)."""
    return {
        "seq": str(entry.seq),
        "time": when(entry.time),
        "kind": entry.kind,
        "summary": redact(entry.summary),
        "who": who(entry.org_id, entry.user_id),
        "incarnation": str(entry.incarnation or ""),
    }


def who(org: str | None, user: str | None) -> str:
    return " / ".join(x for x in (org, user) if x)


def session_of(event: events.Event) -> str | None:
    """The session an event concerns, if any (its own field, else its metadata's)."""
    own = getattr(event, "session_id", None)
    return own if isinstance(own, str) and own else event.meta.session_id


def visible_event(event: events.Event, bound: str | None, owner: str | None) -> bool:
    """Whether a console login sees an event of the audit stream: the operator all; a key
    bound to an organisation the events its organisation caused and those of its sessions
    (``owner``: the organisation of the session incarnation the event belongs to, if it
    concerns a session: never the id's current owner, who may have created it again)."""
    if bound is None:
        return True
    return event.meta.org_id == bound or (session_of(event) is not None and owner == bound)


class AuditRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One event of the audit stream as the console sends it to the page (live)."""

    seq: int
    time: str
    type: str
    session: str
    summary: str
    who: str
    by: str


def audit_record(seq: int, event: events.Event) -> AuditRecord:
    shown = describe.line(event)
    meta = event.meta
    return AuditRecord(
        seq=seq,
        time=when(meta.time),
        type=events.tag_of(type(event)),
        session=session_of(event) or "",
        summary=redact(shown[:SUMMARY_MAX] + ("…" if len(shown) > SUMMARY_MAX else "")),
        who=who(meta.org_id, meta.user_id),
        by=f"{meta.service}/{meta.instance}",
    )


# ---- the system: instances, health, gauges, replay ---------------------------------


@dataclass(frozen=True)
class InstanceRow:
    service: str
    instance: str
    host: str
    pid: str
    liveness: str
    version: str
    since: str
    report_age: str
    details: str


def instance_rows(
    reports: Sequence[health.HealthReport], recorded: Iterable[states.InstanceState], now: datetime
) -> list[InstanceRow]:
    """Every instance that reports its health, then those recorded as running that no
    longer report (crashed, or their machine is gone)."""
    rows = [
        InstanceRow(
            service=r.service,
            instance=r.instance,
            host=r.host,
            pid=str(r.pid),
            liveness=health.liveness(r, now),
            version=r.version,
            since=when(r.started_at),
            report_age=f"{(now - r.reported_at).total_seconds():.1f}s",
            details=redact(" ".join(f"{k}={v}" for k, v in sorted(r.details.items()))),
        )
        for r in reports
    ]
    reporting = {(r.service, r.instance) for r in reports}
    for i in sorted(recorded, key=lambda i: (i.service, i.instance)):
        if i.status == "running" and (i.service, i.instance) not in reporting:
            rows.append(
                InstanceRow(
                    service=i.service,
                    instance=i.instance,
                    host=i.host,
                    pid=str(i.pid),
                    liveness="no report",
                    version=i.version,
                    since=when(i.started_at),
                    report_age="",
                    details="recorded as started, never stopped, no longer reporting",
                )
            )
    return rows


@dataclass(frozen=True)
class Gauge:
    name: str
    value: int
    note: str = ""


@dataclass(frozen=True)
class Gauges:
    pool: list[Gauge] = field(default_factory=list)
    proxies: list[Gauge] = field(default_factory=list)


def gauges(
    sandboxes: Iterable[states.SandboxState],
    proxies: Iterable[states.ProxyState],
    reports: Sequence[health.HealthReport],
) -> Gauges:
    """The warm pool (its sandboxes by state, idle ones by pool, as the pool-manager
    counts them too) and the proxy fleet (proxies by state, sandboxes on each)."""
    boxes = list(sandboxes)
    pooled = [b for b in boxes if b.pool]
    by_state = collections.Counter(b.status for b in pooled)
    idle = collections.Counter(b.pool for b in pooled if b.status == "running" and b.session_id is None)
    pool = [Gauge("pool sandboxes: " + s, by_state.get(s, 0)) for s in ("requested", "running", "paused")]
    pool.append(Gauge("idle (ready to be claimed)", sum(idle.values())))
    pool += [Gauge(f"idle in pool {name}", n) for name, n in sorted(idle.items()) if name]
    for r in reports:
        if r.service == "pool-manager":
            pool += [
                Gauge(f"{k.removeprefix('idle:')}: idle, as {r.instance} counts", _int(v))
                for k, v in sorted(r.details.items())
                if k.startswith("idle:")
            ]
    fleet = list(proxies)
    proxy_state = collections.Counter(p.status for p in fleet)
    out = [Gauge("proxies: " + s, proxy_state.get(s, 0)) for s in ("running", "draining")]
    live = {b.proxy_id for b in boxes if b.status in ("running", "paused") and b.proxy_id}
    on_each = collections.Counter(b.proxy_id for b in boxes if b.status in ("running", "paused"))
    out += [
        Gauge(f"sandboxes on {p.proxy_id}", on_each.get(p.proxy_id, 0), p.status)
        for p in sorted(fleet, key=lambda p: p.proxy_id)
        if p.status != "stopped" or p.proxy_id in live
    ]
    return Gauges(pool=pool, proxies=out)


def _int(text: str) -> int:
    return int(text) if text.isdigit() else 0


@dataclass(frozen=True)
class ReplayView:
    ok: bool
    headline: str
    lines: list[str]


def replay_view(
    events_folded: int, seconds: float, aggregates: Mapping[str, int], differences: Sequence[Any]
) -> ReplayView:
    """``sbx replay --verify``'s result as the console shows it (``differences``: each
    with a ``describe()``)."""
    sizes = ", ".join(f"{k}: {n}" for k, n in aggregates.items())
    headline = f"replayed {events_folded} events in {seconds:.2f}s ({sizes or 'no aggregates'})"
    if not differences:
        return ReplayView(ok=True, headline=headline, lines=["projections match the event stream"])
    lines = [d.describe() for d in differences[:200]]
    lines.append(f"{len(differences)} projection entries differ from the stream")
    return ReplayView(ok=False, headline=headline, lines=lines)


def user_name(text: str | None) -> str:
    """The name given at login: required, attribution rules (recorded on events)."""
    value = (text or "").strip()
    if not value:
        raise errors.InvalidInput("give your name: it is recorded on what you do")
    checked = ids.validate_attribution(value, what="your name")
    assert checked is not None
    return checked
