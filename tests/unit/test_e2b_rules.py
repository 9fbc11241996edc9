"""The E2B surface's pure rules: ids, deadlines, visibility, filters and paging."""

from __future__ import annotations

import urllib.parse
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sbx_api import errors
from services.gateway.e2b import rules
from shared.contract import states

T0 = datetime(2026, 12, 5, 3, 0, tzinfo=UTC)


def session(sid: str, minute: int = 0, org: str | None = "acme", **labels: str) -> states.SessionState:
    at = T0 + timedelta(minutes=minute)
    return states.SessionState(
        session_id=sid, status="active", org_id=org, created_at=at, updated_at=at, last_seq=1, metadata=labels
    )


def test_an_idempotency_key_names_one_sandbox_per_organisation() -> None:
    assert rules.sandbox_id("acme", "k", "x" * 32) == rules.sandbox_id("acme", "k", "y" * 32)
    assert rules.sandbox_id("acme", "k", "x" * 32) != rules.sandbox_id("globex", "k", "x" * 32)
    assert rules.sandbox_id(None, None, "ab" * 16) == "e2b" + ("ab" * 16)[:20]


def test_deadlines_are_bounded() -> None:
    assert rules.deadline(T0, 300) == T0 + timedelta(seconds=300)
    for bad in (0, -1, rules.MAX_TIMEOUT + 1):
        with pytest.raises(errors.InvalidInput):
            rules.deadline(T0, bad)


def test_an_org_bound_key_sees_its_organisation_only() -> None:
    assert rules.visible("acme", session("a"))
    assert not rules.visible("acme", session("a", org="globex"))
    assert not rules.visible("acme", session("a", org=None))  # no organisation: the operator's
    assert rules.visible(None, session("a", org="globex"))
    assert not rules.visible(None, None)


def test_the_sdks_metadata_filter_decodes() -> None:
    wanted = {"a b": "c&d", "k": "v=1"}
    raw = urllib.parse.urlencode({urllib.parse.quote(k): urllib.parse.quote(v) for k, v in wanted.items()})
    assert rules.parse_metadata_filter(raw) == wanted
    assert rules.matches(session("s", **{"a b": "c&d", "k": "v=1", "x": "y"}), wanted)
    assert not rules.matches(session("s", k="v=1"), wanted)


def test_bad_queries_are_refused() -> None:
    with pytest.raises(errors.InvalidInput):
        rules.parse_states("running,dead")
    with pytest.raises(errors.InvalidInput):
        rules.parse_limit("0")
    with pytest.raises(errors.InvalidInput):
        rules.decode_cursor("not base64 json!")


@given(st.integers(1, 12), st.integers(1, 5), st.booleans())
def test_pages_cover_every_session_once(count: int, limit: int, descending: bool) -> None:
    everyone = [session(f"s{n}", minute=n % 3) for n in range(count)]
    seen: list[str] = []
    cursor = None
    while True:
        shown, token = rules.page(everyone, cursor, limit, descending=descending)
        seen += [s.session_id for s in shown]
        if token is None:
            break
        cursor = rules.decode_cursor(token)
    assert sorted(seen) == sorted(s.session_id for s in everyone) and len(seen) == count


def test_a_metrics_range_gets_the_reading_taken_now_only_if_it_covers_now() -> None:
    unix = str(int(T0.timestamp()))
    assert rules.parse_unix(unix, "start") == T0 and rules.parse_unix(None, "end") is None
    for bad in ("-1", "1.5", "soon", "9" * 13):
        with pytest.raises(errors.InvalidInput, match="end must be a Unix time"):
            rules.parse_unix(bad, "end")
    hour = timedelta(hours=1)
    assert rules.now_in(T0, None, None) and rules.now_in(T0, T0 - hour, T0)
    assert not rules.now_in(T0, T0 - 2 * hour, T0 - hour)  # ended an hour ago: nothing kept
    assert not rules.now_in(T0, T0 + hour, None)  # starts later


def test_a_usage_reading_is_e2bs_metric() -> None:
    from shared.contract import execution

    usage = execution.Usage(
        at=T0, cpus=0.5, cpu_seconds=3.0, cpu_percent=42.5, memory_bytes=300, memory_cache_bytes=100,
        memory_limit=1000, disk_bytes=7, disk_limit=70,
    )  # fmt: skip
    metric = rules.metric(usage)
    assert (metric.cpuCount, metric.cpuUsedPct, metric.timestampUnix) == (1, 42.5, int(T0.timestamp()))
    assert (metric.memUsed, metric.memCache, metric.memTotal) == (300, 100, 1000)
    assert (metric.diskUsed, metric.diskTotal) == (7, 70)
