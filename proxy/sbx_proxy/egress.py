"""What the proxy saw of each sandbox connection, and its verdict (pure: no I/O, no mitmproxy).

The front door (``front.py``) and the addon (``addon.py``) report what they observe here,
and only here: a connection opened, where it goes and how it is handled (tunnelled,
intercepted under a rule, plain HTTP forwarded), each request and its outcome, each
refusal and why, upstream failures, bytes each way, the close. A :class:`Tracker` keeps
one :class:`Connection` per sandbox connection and tells its sinks; the Prometheus
counters (``metrics.py``) are one sink, and the per-connection egress records
(``records.py``: the sessions' audit trail, built from :meth:`Connection.record`) are
another.

Everything a label can take is a closed enum here (verdicts, reasons, stages, outcomes,
directions); the only other label is a configured rule's name. A host, an address or a
path a sandbox chose never becomes a label.

Threads: the front relays bytes in threads of its own, so a :class:`Meter` is called
from them (it adds to one connection's counters and, every MiB, calls the sinks'
``transferred``, which must be thread-safe); everything else runs on the event loop, and
a connection is closed only once its relays have ended.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

DETAIL_MAX = 200
"""A refusal's text is kept up to this many characters."""


class Verdict(enum.StrEnum):
    """What became of a connection, decided when it closes (:func:`verdict`)."""

    TUNNELLED = "tunnelled"
    """A CONNECT to a host without a rule: bytes relayed, nothing seen or added."""
    INTERCEPTED = "intercepted"
    """A CONNECT to a host with a rule: TLS terminated, requests checked, credential added."""
    FORWARDED = "forwarded"
    """Plain-HTTP requests forwarded by the proxy (never credentialed)."""
    REFUSED = "refused"
    """Nothing went upstream: the CONNECT, or every request on it, was refused."""
    EMPTY = "empty"
    """Closed before a request came (a port probe, a client that gave up)."""


class Reason(enum.StrEnum):
    """Why the proxy refused something (a CONNECT, a request or an answer)."""

    PRIVATE_ADDRESS = "private_address"
    """The destination resolves to a loopback, private, link-local, shared, reserved or
    non-unicast address (``[destinations]`` can allow networks)."""
    METADATA_ADDRESS = "metadata_address"
    """The destination is a cloud metadata address (169.254.169.254, fd00:ec2::254, ...)."""
    UNRESOLVABLE = "unresolvable"
    """The destination's name does not resolve (or has no address)."""
    HOST_MISMATCH = "host_mismatch"
    """Inside a credentialed tunnel, the TLS server name, ``Host`` or request target
    names another host than the CONNECT did (421)."""
    BAD_REQUEST = "bad_request"
    """Malformed or smuggling-prone request: folded or bad header lines, conflicting
    lengths (400); or no request head within the head timeout."""
    CREDENTIAL_UNAVAILABLE = "credential_unavailable"
    """The rule could not produce its credential (token endpoint down, hook failed): 502,
    never forwarded without it."""
    UPSTREAM_FAILURE = "upstream_failure"
    """The destination could not be reached (connect or TLS failed): 502."""
    PROXY_ITSELF = "proxy_itself"
    """The destination is the proxy's own listening address (allowed private ranges can
    include it): a request to itself would loop."""
    UNCHECKED_TUNNEL = "unchecked_tunnel"
    """A credentialed request in a tunnel whose destination was never checked (a bug
    guard; should stay at zero)."""
    COMPRESSED_ANSWER = "compressed_answer"
    """A credentialed request's answer came compressed (it could carry the secret
    unseen): replaced by an empty 502."""


class Stage(enum.StrEnum):
    """Where an upstream connection failed."""

    CONNECT = "connect"
    TLS = "tls"
    PROTOCOL = "protocol"
    """The upstream broke an exchange after it had started (reset, invalid answer)."""


class Outcome(enum.StrEnum):
    """What became of one request the proxy saw (intercepted or plain HTTP)."""

    INJECTED = "injected"
    PASSED = "passed"
    """Forwarded without a credential (plain HTTP, or a rule that added none)."""
    REFUSED = "refused"


class Direction(enum.StrEnum):
    UP = "up"
    """From the sandbox towards the destination."""
    DOWN = "down"


class Mode(enum.StrEnum):
    """How the proxy handles a connection, once it knows."""

    TUNNEL = "tunnel"
    INTERCEPT = "intercept"
    FORWARD = "forward"


@dataclass(eq=False)
class Connection:
    """One sandbox connection, filled in as the proxy learns about it."""

    id: int
    peer: tuple[str, int] | None
    """The sandbox side's address (which sandbox: the session lookup of issue 21)."""
    started: float
    host: str | None = None
    """Where it goes: the CONNECT target, or the plain-HTTP request's host (last one)."""
    port: int | None = None
    mode: Mode | None = None
    rule: str | None = None
    """The configured rule whose host this is (intercepted connections)."""
    requests: int = 0
    injected: int = 0
    refused: int = 0
    """Refusals on this connection (the CONNECT itself, or requests)."""
    reason: Reason | None = None
    """The first refusal's reason."""
    detail: str | None = None
    """The first refusal's text (the checker's words: an address, a name; never a header
    value)."""
    upstream_errors: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    ended: float | None = None
    hop: tuple[str, int] | None = None
    """The front's address on its hop to mitmproxy, when it handed the connection over."""
    meters: list[Meter] = field(default_factory=list)
    """Its byte counters (flushed to the sinks when it closes)."""
    flags: set[str] = field(default_factory=set)
    """Observation points' own marks (e.g. a refusal already counted for an upstream
    connection mitmproxy will report failed)."""

    @property
    def verdict(self) -> Verdict:
        return verdict(self)

    def record(self) -> Record:
        """An immutable summary: what the connection's egress record holds (no
        header, no path, no secret)."""
        return Record(
            id=self.id,
            peer=self.peer,
            host=self.host,
            port=self.port,
            verdict=self.verdict,
            rule=self.rule,
            reason=self.reason,
            detail=self.detail,
            requests=self.requests,
            injected=self.injected,
            refused=self.refused,
            upstream_errors=self.upstream_errors,
            bytes_up=self.bytes_up,
            bytes_down=self.bytes_down,
            seconds=(self.ended if self.ended is not None else self.started) - self.started,
        )


@dataclass(frozen=True)
class Record:
    id: int
    peer: tuple[str, int] | None
    host: str | None
    port: int | None
    verdict: Verdict
    rule: str | None
    reason: Reason | None
    detail: str | None
    requests: int
    injected: int
    refused: int
    upstream_errors: int
    bytes_up: int
    bytes_down: int
    seconds: float


@dataclass(frozen=True)
class Refusal:
    """A refusal as a checker states it: the reason (bounded) and a text for people (may
    name the host or address; never a label, never a secret)."""

    reason: Reason
    detail: str

    def __str__(self) -> str:
        return self.detail


def verdict(conn: Connection) -> Verdict:
    """A connection that carried something upstream is judged by how it was handled;
    one that carried nothing is ``refused`` if anything on it was refused, else ``empty``."""
    carried = conn.requests > conn.refused or (conn.mode is Mode.TUNNEL and conn.refused == 0)
    if conn.mode is not None and carried:
        return {Mode.TUNNEL: Verdict.TUNNELLED, Mode.INTERCEPT: Verdict.INTERCEPTED}.get(
            conn.mode, Verdict.FORWARDED
        )
    if conn.refused:
        return Verdict.REFUSED
    if conn.mode is Mode.INTERCEPT:  # a tunnel set up, no request yet (TLS only, then closed)
        return Verdict.INTERCEPTED
    return Verdict.EMPTY


class Sink(Protocol):
    """Told about every observation (metrics, egress records)."""

    def opened(self, conn: Connection) -> None: ...

    def requested(self, conn: Connection, outcome: Outcome, rule: str | None) -> None: ...

    def refused(self, conn: Connection, reason: Reason) -> None: ...

    def upstream_failed(self, conn: Connection, stage: Stage) -> None: ...

    def transferred(self, direction: Direction, count: int) -> None: ...

    def closed(self, conn: Connection) -> None: ...


class Tracker:
    """The connections open now and the observation points' single entry."""

    def __init__(self, sinks: Iterable[Sink] = (), clock: Callable[[], float] = time.monotonic) -> None:
        self.sinks = tuple(sinks)
        self.clock = clock
        self.open: dict[int, Connection] = {}
        self._handed: dict[tuple[str, int], Connection] = {}
        """Connections the front handed to mitmproxy, by the front's own address on that
        hop (mitmproxy sees it as its client's peer address)."""
        self._ids = itertools.count(1)

    # ---- life --------------------------------------------------------------------

    def opened(self, peer: tuple[str, int] | None) -> Connection:
        conn = Connection(id=next(self._ids), peer=peer, started=self.clock())
        self.open[conn.id] = conn
        for sink in self.sinks:
            sink.opened(conn)
        return conn

    def detached(self, peer: tuple[str, int] | None) -> Connection:
        """A record for observations that come after their connection closed (a late
        hook): the sinks hear them, but it is neither open nor ever closed."""
        return Connection(id=next(self._ids), peer=peer, started=self.clock())

    def closed(self, conn: Connection) -> Record | None:
        """The connection's record, once (a second close is ignored: None)."""
        if self.open.pop(conn.id, None) is None:
            return None
        if conn.hop is not None and self._handed.get(conn.hop) is conn:
            del self._handed[conn.hop]
        conn.ended = self.clock()
        for meter in conn.meters:
            meter.flush()
        for sink in self.sinks:
            sink.closed(conn)
        return conn.record()

    def handed(self, conn: Connection, hop: tuple[str, int]) -> None:
        """The front passes ``conn`` to mitmproxy from its local address ``hop``."""
        conn.hop = (str(hop[0]), int(hop[1]))
        self._handed[conn.hop] = conn

    def by_hop(self, hop: tuple[str, int] | None) -> Connection | None:
        return None if hop is None else self._handed.get((str(hop[0]), int(hop[1])))

    # ---- what happens on it ------------------------------------------------------

    def routed(self, conn: Connection, mode: Mode, host: str, port: int, rule: str | None = None) -> None:
        conn.mode, conn.host, conn.port = mode, host, port
        if rule is not None:
            conn.rule = rule

    def requested(self, conn: Connection, outcome: Outcome, rule: str | None = None) -> None:
        """A request the proxy saw; a refused one is also reported by :meth:`refused`."""
        conn.requests += 1
        if outcome is Outcome.INJECTED:
            conn.injected += 1
        for sink in self.sinks:
            sink.requested(conn, outcome, rule)

    def refused(self, conn: Connection, refusal: Refusal | Reason, *, request: bool = False) -> None:
        """The proxy refused the connection's CONNECT, or (``request``) one request on it."""
        reason = refusal.reason if isinstance(refusal, Refusal) else refusal
        if request:
            self.requested(conn, Outcome.REFUSED)
        conn.refused += 1
        if conn.reason is None:
            conn.reason = reason
            if isinstance(refusal, Refusal):
                conn.detail = refusal.detail[:DETAIL_MAX]
        for sink in self.sinks:
            sink.refused(conn, reason)

    def upstream_failed(self, conn: Connection, stage: Stage) -> None:
        conn.upstream_errors += 1
        for sink in self.sinks:
            sink.upstream_failed(conn, stage)

    def counter(self, conn: Connection, direction: Direction) -> Meter:
        """What the relay calls with every count of bytes it moved one way."""
        meter = Meter(conn, direction, self.sinks)
        conn.meters.append(meter)
        return meter


class Meter:
    """Bytes one way on one connection: added to the connection at once, passed to the
    sinks in steps of ``STEP`` (a relay moves a GiB in some 16k splices: a counter update
    with its lock for each would be a measurable share of the relay's CPU), and the rest
    when the connection closes."""

    STEP = 1 << 20
    __slots__ = ("conn", "direction", "pending", "sinks", "up")

    def __init__(self, conn: Connection, direction: Direction, sinks: tuple[Sink, ...]) -> None:
        self.conn, self.direction, self.sinks = conn, direction, sinks
        self.up = direction is Direction.UP
        self.pending = 0

    def __call__(self, count: int) -> None:
        if self.up:
            self.conn.bytes_up += count
        else:
            self.conn.bytes_down += count
        self.pending += count
        if self.pending >= self.STEP:
            self.flush()

    def flush(self) -> None:
        pending, self.pending = self.pending, 0
        if pending:
            for sink in self.sinks:
                sink.transferred(self.direction, pending)
