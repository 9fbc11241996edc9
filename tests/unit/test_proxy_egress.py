"""The proxy's egress records and their metrics (pure: ``sbx_proxy.egress``, and the
Prometheus sink in ``sbx_proxy.metrics`` fed by hand, without mitmproxy)."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sbx_proxy import egress, metrics

E = egress


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Log:
    """A sink that writes down what it is told."""

    def __init__(self) -> None:
        self.seen: list[tuple] = []

    def opened(self, conn):
        self.seen.append(("opened", conn.id))

    def requested(self, conn, outcome, rule):
        self.seen.append(("requested", outcome, rule))

    def refused(self, conn, reason):
        self.seen.append(("refused", reason))

    def upstream_failed(self, conn, stage):
        self.seen.append(("upstream", stage))

    def transferred(self, direction, count):
        self.seen.append(("bytes", direction, count))

    def closed(self, conn):
        self.seen.append(("closed", conn.verdict))


def conn(**fields) -> E.Connection:
    c = E.Connection(id=1, peer=None, started=0.0)
    for k, v in fields.items():
        setattr(c, k, v)
    return c


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, E.Verdict.EMPTY),
        ({"mode": E.Mode.TUNNEL}, E.Verdict.TUNNELLED),
        ({"mode": E.Mode.TUNNEL, "refused": 1}, E.Verdict.REFUSED),  # its upstream was down
        ({"refused": 1}, E.Verdict.REFUSED),  # the CONNECT refused
        ({"mode": E.Mode.INTERCEPT}, E.Verdict.INTERCEPTED),  # TLS only, no request yet
        ({"mode": E.Mode.INTERCEPT, "requests": 2, "refused": 1}, E.Verdict.INTERCEPTED),
        ({"mode": E.Mode.INTERCEPT, "requests": 1, "refused": 1}, E.Verdict.REFUSED),
        ({"mode": E.Mode.FORWARD, "requests": 1}, E.Verdict.FORWARDED),
        ({"mode": E.Mode.FORWARD, "requests": 1, "refused": 1}, E.Verdict.REFUSED),
        ({"requests": 1, "refused": 1}, E.Verdict.REFUSED),  # a request refused before it was routed
    ],
)
def test_the_verdict_follows_what_went_upstream(fields, expected):
    assert E.verdict(conn(**fields)) is expected


def test_a_connection_tells_every_sink_and_closes_once_into_a_record():
    clock, log = Clock(), Log()
    tracker = E.Tracker([log], clock=clock)
    c = tracker.opened(("10.213.0.5", 40000))
    tracker.routed(c, E.Mode.INTERCEPT, "github.com", 443, "github")
    tracker.requested(c, E.Outcome.INJECTED, "github")
    tracker.refused(c, E.Reason.HOST_MISMATCH, request=True)
    tracker.counter(c, E.Direction.UP)(100)
    tracker.counter(c, E.Direction.DOWN)(2000)
    clock.now = 102.5
    record = tracker.closed(c)
    assert tracker.closed(c) is None, "a second close is ignored"
    assert record == E.Record(
        id=c.id, peer=("10.213.0.5", 40000), host="github.com", port=443, verdict=E.Verdict.INTERCEPTED,
        rule="github", reason=E.Reason.HOST_MISMATCH, detail=None, requests=2, injected=1, refused=1,
        upstream_errors=0, bytes_up=100, bytes_down=2000, seconds=2.5,
    )  # fmt: skip
    assert log.seen == [
        ("opened", c.id),
        ("requested", E.Outcome.INJECTED, "github"),
        ("requested", E.Outcome.REFUSED, None),
        ("refused", E.Reason.HOST_MISMATCH),
        ("bytes", E.Direction.UP, 100),
        ("bytes", E.Direction.DOWN, 2000),
        ("closed", E.Verdict.INTERCEPTED),
    ]
    assert tracker.open == {}


def test_a_connection_handed_to_mitmproxy_is_found_by_its_hop_until_it_closes():
    tracker = E.Tracker()
    c = tracker.opened(("10.213.0.5", 40000))
    tracker.handed(c, ("127.0.0.1", 51000))
    assert tracker.by_hop(("127.0.0.1", 51000)) is c
    assert tracker.by_hop(("127.0.0.1", 51001)) is None and tracker.by_hop(None) is None
    tracker.closed(c)
    assert tracker.by_hop(("127.0.0.1", 51000)) is None


def test_the_first_reason_is_kept_and_a_refusal_reads_as_its_text():
    tracker = E.Tracker()
    c = tracker.opened(None)
    tracker.refused(c, E.Refusal(E.Reason.METADATA_ADDRESS, "169.254.169.254 is a cloud metadata address"))
    tracker.refused(c, E.Reason.BAD_REQUEST)
    assert c.reason is E.Reason.METADATA_ADDRESS and c.refused == 2
    assert f"{E.Refusal(E.Reason.UNRESOLVABLE, 'cannot resolve x')}" == "cannot resolve x"


def samples(m: metrics.Metrics) -> dict:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(m.render().decode())
        for s in family.samples
    }


def test_the_metrics_are_derived_from_the_observations_with_bounded_labels():
    m = metrics.Metrics()
    m.rules(["github", "npm"])
    clock = Clock()
    tracker = E.Tracker([m], clock=clock)
    before = samples(m)
    for verdict in E.Verdict:
        assert before[("sbx_proxy_connections_total", (("verdict", verdict.value),))] == 0
    for reason in E.Reason:
        assert before[("sbx_proxy_refusals_total", (("reason", reason.value),))] == 0
    assert before[("sbx_proxy_injections_total", (("rule", "npm"),))] == 0

    c = tracker.opened(None)
    assert samples(m)[("sbx_proxy_active_connections", ())] == 1
    tracker.routed(c, E.Mode.INTERCEPT, "attacker-chosen.example", 443, "github")
    tracker.requested(c, E.Outcome.INJECTED, "github")
    tracker.requested(c, E.Outcome.INJECTED, "github")
    tracker.upstream_failed(c, E.Stage.TLS)
    tracker.counter(c, E.Direction.UP)(10)
    tracker.counter(c, E.Direction.UP)(5)
    clock.now += 0.2
    tracker.closed(c)
    r = tracker.opened(None)
    tracker.refused(r, E.Reason.PRIVATE_ADDRESS)
    tracker.closed(r)

    after = samples(m)
    assert after[("sbx_proxy_active_connections", ())] == 0
    assert after[("sbx_proxy_connections_total", (("verdict", "intercepted"),))] == 1
    assert after[("sbx_proxy_connections_total", (("verdict", "refused"),))] == 1
    assert after[("sbx_proxy_injections_total", (("rule", "github"),))] == 2
    assert after[("sbx_proxy_requests_total", (("outcome", "injected"),))] == 2
    assert after[("sbx_proxy_refusals_total", (("reason", "private_address"),))] == 1
    assert after[("sbx_proxy_upstream_errors_total", (("stage", "tls"),))] == 1
    assert after[("sbx_proxy_bytes_total", (("direction", "up"),))] == 15
    assert after[("sbx_proxy_connection_seconds_sum", (("verdict", "intercepted"),))] == pytest.approx(0.2)
    assert set(after) - set(before) == set(), "no series appears that was not there from the start"
    assert "attacker-chosen" not in m.render().decode()


def test_bytes_reach_the_sinks_in_steps_and_in_full_at_the_close():
    log = Log()
    tracker = E.Tracker([log])
    c = tracker.opened(None)
    meter = tracker.counter(c, E.Direction.DOWN)
    for _ in range(50):
        meter(64 * 1024)  # 3.125 MiB
    assert c.bytes_down == 50 * 64 * 1024, "the connection's own count is always exact"
    steps = [n for kind, *rest in log.seen if kind == "bytes" for _, n in [rest]]
    assert steps == [E.Meter.STEP] * 3
    tracker.closed(c)
    steps = [n for kind, *rest in log.seen if kind == "bytes" for _, n in [rest]]
    assert sum(steps) == 50 * 64 * 1024 and len(steps) == 4


def test_a_late_observation_is_counted_without_opening_anything():
    log = Log()
    tracker = E.Tracker([log])
    late = tracker.detached(("127.0.0.1", 5000))
    tracker.upstream_failed(late, E.Stage.CONNECT)
    assert tracker.open == {} and log.seen == [("upstream", E.Stage.CONNECT)]
    assert tracker.closed(late) is None, "never open, never closed"
