"""Egress records, pure parts: the proxy's log (batches handed out until acknowledged,
bounded by aggregation and then by counting what is lost), the batch-to-events rule
(per address and session, chunked, ids derived so a batch read twice is stored once),
and the timeline entry an ``egress.recorded`` event makes."""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec

from sbx_proxy import egress as proxy_egress
from sbx_proxy import records
from shared.contract import events
from shared.domain import describe, egress, timeline


def entry(
    peer: str | None = "10.213.0.2", host: str = "pypi.org", verdict: str = "tunnelled", **kw
) -> records.Entry:
    fields = {
        "peer": peer, "host": host, "port": 443, "verdict": verdict, "rule": None, "reason": None,
        "detail": None, "started": 1000.0, "seconds": 0.5, "requests": 0, "injected": 0, "refused": 0,
        "upstream_errors": 0, "bytes_up": 10, "bytes_down": 20,
    } | kw  # fmt: skip
    return records.Entry(**fields)


def test_a_batch_is_handed_out_again_until_acknowledged():
    log = records.EgressLog()
    log.add(entry())
    first = log.collect(ack=0)
    assert first.number == 1 and len(first.entries) == 1
    log.add(entry(host="files.pythonhosted.org"))
    assert log.collect(ack=0) is first, "not acknowledged: the same batch"
    second = log.collect(ack=1)
    assert second.number == 2 and [e.host for e in second.entries] == ["files.pythonhosted.org"]
    assert log.collect(ack=2).entries == [] and log.waiting == 0


def test_a_closed_connection_becomes_an_entry():
    tracker = proxy_egress.Tracker(clock=iter([10.0, 12.5]).__next__)
    log = records.EgressLog(wall=lambda: 5000.0)
    tracker.sinks = (log,)
    conn = tracker.opened(("10.213.0.6", 40000))
    tracker.refused(
        conn, proxy_egress.Refusal(proxy_egress.Reason.PRIVATE_ADDRESS, "10.0.0.1 is private" * 30)
    )
    conn.host, conn.port = "10.0.0.1", 80
    tracker.closed(conn)
    (only,) = log.collect(0).entries
    wire = only.wire()
    assert wire["peer"] == "10.213.0.6" and wire["verdict"] == "refused"
    assert wire["reason"] == "private_address" and len(wire["detail"]) == proxy_egress.DETAIL_MAX
    assert wire["started"] == 5000.0 - 2.5 and wire["ms"] == 2500


def test_one_address_past_its_bound_is_aggregated_by_destination_and_verdict():
    log = records.EgressLog(per_peer=3)
    for n in range(3):
        log.add(entry(host=f"h{n}"))
    for _ in range(50):
        log.add(entry(host="a.example"))
    for _ in range(7):
        log.add(entry(host="b.example", verdict="refused", reason="private_address"))
    log.add(entry(peer="10.213.0.10", host="other"))  # another sandbox keeps its own bound
    batch = log.collect(0)
    assert len(batch.entries) == 6
    aggregates = {e.host: e for e in batch.entries if e.folded}
    assert aggregates["a.example"].connections == 50 and aggregates["a.example"].bytes_up == 500
    assert aggregates["b.example"].connections == 7 and aggregates["b.example"].seconds == 3.5
    assert batch.aggregated == 49 + 6
    assert sum(e.connections for e in batch.entries) == 3 + 50 + 7 + 1


def test_past_the_pending_bound_connections_are_counted_as_lost():
    log = records.EgressLog(per_peer=1, pending_max=3)
    for n in range(10):
        log.add(entry(peer=f"10.213.0.{n}"))  # ten sandboxes: three kept, then lost
    batch = log.collect(0)
    assert len(batch.entries) == 3 and batch.lost == 7 and log.lost_total == 7 and log.recorded == 10
    assert log.collect(1).lost == 0


def test_a_batch_is_cut_at_its_size_bound_and_the_rest_waits():
    log = records.EgressLog(batch_max=2)
    for n in range(5):
        log.add(entry(peer=f"10.213.0.{n}"))
    assert len(log.collect(0).entries) == 2 and log.waiting == 5
    assert len(log.collect(1).entries) == 2
    assert len(log.collect(2).entries) == 1 and log.waiting == 1


def wire_batch(number: int, peers: dict[str | None, int], lost: int = 0) -> egress.WireBatch:
    data = {
        "batch": number,
        "lost": lost,
        "records": [
            entry(peer=peer, host=f"h{i}").wire() for peer, count in peers.items() for i in range(count)
        ],
    }
    return egress.decode_batch(msgspec.json.encode(data))


def meta(event_id: str, owner: egress.Owner | None) -> events.Meta:
    return events.Meta(
        event_id=event_id, time=datetime(2026, 1, 1, tzinfo=UTC), service="proxy-scaler", instance="i",
        session_id=owner.session_id if owner else None,
    )  # fmt: skip


OWNERS = {"10.213.0.2": egress.Owner("sb-1", "task-1"), "10.213.0.6": egress.Owner("sb-2", None)}


def test_a_batch_makes_one_event_per_address_on_its_sessions_subject():
    made = egress.recorded(
        "px-1", wire_batch(4, {"10.213.0.2": 2, "10.213.0.6": 1, "10.9.9.9": 1}), OWNERS.get, meta
    )
    assert [(e.session_id, e.sandbox_id, e.aggregate_id, len(e.connections)) for e in made] == [
        ("task-1", "sb-1", "task-1", 2),
        (None, "sb-2", "sb-2", 1),  # a pool sandbox not yet claimed: its own subject
        (None, None, "px-1", 1),  # an address no sandbox was known to hold
    ]
    assert made[0].meta.session_id == "task-1" and made[0].connections[0].host == "h0"
    again = egress.recorded("px-1", wire_batch(4, {"10.213.0.2": 2}), OWNERS.get, meta)
    assert again[0].meta.event_id == made[0].meta.event_id, "a batch read twice: the same ids"
    later = egress.recorded("px-1", wire_batch(5, {"10.213.0.2": 2}), OWNERS.get, meta)
    assert later[0].meta.event_id != made[0].meta.event_id


def test_large_batches_are_chunked_and_lost_connections_reported():
    made = egress.recorded("px-1", wire_batch(1, {"10.213.0.2": egress.CHUNK + 3}, lost=9), OWNERS.get, meta)
    assert [len(e.connections) for e in made] == [egress.CHUNK, 3, 0]
    assert made[-1].lost == 9 and made[-1].session_id is None
    assert len({e.meta.event_id for e in made}) == 3


def test_an_egress_event_is_a_timeline_entry_of_its_session():
    (event,) = egress.recorded("px-1", wire_batch(1, {"10.213.0.2": 1}), OWNERS.get, meta)
    members = timeline.Membership("task-1")
    assert members.owns(7, event) and not timeline.Membership("task-2").owns(7, event)
    found = timeline.entry_of(7, event)
    assert found is not None and found.kind == "egress" and found.sandbox_id == "sb-1"
    assert found.summary == "egress: 1 connection: h0:443 tunnelled"
    assert found.connections is not None and found.connections[0].host == "h0"
    assert timeline.kinds(["egress"]) == frozenset({"egress"})


def test_a_sandbox_naming_thousands_of_hosts_keeps_a_bounded_share():
    """Unique destinations cannot be folded by destination: past twice its bound an
    address's connections fold by verdict alone, so another sandbox's records still fit."""
    log = records.EgressLog(per_peer=10, pending_max=100)
    for n in range(5000):
        log.add(entry(host=f"h{n}.example"))
    log.add(entry(peer="10.213.0.10", host="pypi.org"))
    batch = log.collect(0)
    assert batch.lost == 0 and log.lost_total == 0
    flooding = [e for e in batch.entries if e.peer == "10.213.0.2"]
    assert len(flooding) == 21  # 10 as they are, 10 by destination, 1 by verdict alone
    many = [e for e in flooding if e.host is None]
    assert len(many) == 1 and many[0].connections == 5000 - 20
    assert sum(e.connections for e in flooding) == 5000
    assert [e.host for e in batch.entries if e.peer == "10.213.0.10"] == ["pypi.org"]


def test_a_connection_that_never_named_a_destination_is_not_recorded():
    log = records.EgressLog()
    tracker = proxy_egress.Tracker([log])
    tracker.closed(tracker.opened(("10.213.255.254", 5000)))  # a probe: opened, closed
    assert log.collect(0).entries == [] and log.recorded == 0


def test_egress_events_read_as_one_line():
    (event,) = egress.recorded("px-1", wire_batch(1, {"10.213.0.2": 1}), OWNERS.get, meta)
    assert (
        describe.line(event)
        == "session_id=task-1 sandbox_id=sb-1 proxy_id=px-1 egress: 1 connection: h0:443 tunnelled"
    )
    stopped = events.SessionStopped(meta=meta("x", None), session_id="s", reason="idle")
    assert describe.line(stopped) == "session_id=s reason=idle"
