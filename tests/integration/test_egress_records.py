"""Egress on the audit stream with real parts (proxy-scaler, pool-manager and scheduler
in-process, a real sandbox with proxy-only egress, a real ``sbx-proxy``): what a sandbox
sends through its proxy lands on its session's timeline as ``egress.recorded`` (where,
verdict, why refused), and the sandbox itself reads why it was refused.
"""

from __future__ import annotations

import asyncio

import pytest

from shared.contract import subjects
from shared.infrastructure import eventstore
from shared.infrastructure import timeline as reading
from shared.infrastructure.settings import proxies
from shared.runtime.local import network
from tests.integration.test_proxy_fleet import ensure
from tests.integration.test_proxy_metrics import fleet, in_sandbox

pytestmark = [
    pytest.mark.needs_root("veth pairs and nftables need root"),
    pytest.mark.skipif(network.Network().unavailable() is not None, reason="ip/nft missing"),
    pytest.mark.skipif(
        not proxies.DEFAULT_PROXY_BIN.exists(), reason="proxy/.venv missing: run scripts/setup"
    ),
    pytest.mark.slow,
]
__all__ = ["fleet"]  # the fixture, shared with the metrics tests


async def egress_entries(world, session: str, want: int, timeout: float = 30.0) -> list:
    reader = reading.TimelineReader(
        eventstore.EventStore(world["nc"].jetstream(), world["topology"]), world["topology"]
    )
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        page = await reader.page(await reader.members(session), {"egress"}, limit=1000)
        connections = [c for e in page.entries for c in e.connections or []]
        if sum(c.connections for c in connections) >= want or asyncio.get_running_loop().time() > deadline:
            return page.entries
        await asyncio.sleep(0.2)


async def test_a_sandboxs_connections_land_on_its_timeline_with_their_reasons(fleet):
    sandbox = await ensure(fleet, "eg1")
    out = await in_sandbox(
        fleet,
        sandbox,
        "curl -sS --max-time 10 http://169.254.169.254/latest/; echo; "
        "curl -sS -o /dev/null --max-time 10 -p -x $HTTPS_PROXY https://10.9.8.7:443/ 2>&1; "
        "curl -sS --max-time 10 -p -x $HTTPS_PROXY https://10.9.8.7:443/ -v 2>&1 | grep -i '< HTTP/1.1 403'",
    )
    assert "refused by the sandbox's egress proxy: GET 169.254.169.254:80" in out, out
    assert "reason: metadata_address" in out and "no configuration allows it" in out, out
    assert "403 Private Destination Refused" in out, out

    entries = await egress_entries(fleet, "eg1", want=3)
    connections = [c for e in entries for c in e.connections or []]
    assert sum(c.connections for c in connections) == 3, entries
    assert all(e.kind == "egress" and e.sandbox_id == sandbox for e in entries)
    reasons = sorted((c.host, c.verdict, c.reason) for c in connections for _ in range(c.connections))
    assert reasons == [
        ("10.9.8.7", "refused", "private_address"),
        ("10.9.8.7", "refused", "private_address"),
        ("169.254.169.254", "refused", "metadata_address"),
    ]
    assert any("is a cloud metadata address" in (c.detail or "") for c in connections)
    assert "refused" in entries[0].summary

    # another session's timeline holds none of it
    assert await egress_entries(fleet, "eg-other", want=1, timeout=0.5) == []
    # the records are on the egress subject of the session: the stream is the record
    store = eventstore.EventStore(fleet["nc"].jetstream(), fleet["topology"])
    stored = await store.load(fleet["topology"].aggregate_subject(subjects.EGRESS, "eg1"))
    assert stored and all(s.event.proxy_id for s in stored)
