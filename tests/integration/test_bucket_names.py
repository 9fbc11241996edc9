"""Projection buckets are spelled right (``<ns>_sandboxes``, ``<ns>_proxies``), and a state
dir from before, whose buckets were ``<ns>_sandboxs`` and ``<ns>_proxys``, is moved over
by the topology check every service runs at start (a real nats-server)."""

from __future__ import annotations

import asyncio

import nats.js.errors
import pytest
from nats.js import api

from shared.contract import subjects
from shared.infrastructure import bus as shared_bus
from shared.infrastructure.settings import bus as bus_settings


async def test_buckets_have_their_plural_names(bus):
    nc, topology = bus
    js = nc.jetstream()
    for kind, plural in (
        ("session", "sessions"),
        ("instance", "instances"),
        ("sandbox", "sandboxes"),
        ("proxy", "proxies"),
        ("snapshot", "snapshots"),
    ):
        assert topology.bucket(kind) == f"{topology.namespace}_{plural}"
        await js.key_value(topology.bucket(kind))  # exists
    with pytest.raises(nats.js.errors.NotFoundError):
        await js.key_value(topology.legacy_bucket(subjects.SANDBOX))


async def test_an_old_state_dir_is_moved_to_the_new_names(nats_server, namespace):
    topology = subjects.Topology(namespace)
    nc = await shared_bus.connect(
        bus_settings.BusSettings(nats_url=nats_server.url, namespace=namespace), "test"
    )
    js = nc.jetstream()
    try:
        old = await js.create_key_value(api.KeyValueConfig(bucket=topology.legacy_bucket(subjects.SANDBOX)))
        await old.put("sb-1", b'{"old":1}')
        await old.put("sb-2", b'{"old":2}')
        await old.put("gone", b"x")
        await old.delete("gone")
        # Several services start at once: each runs the check.
        await asyncio.gather(*(shared_bus.ensure_topology(js, topology) for _ in range(3)))
        new = await js.key_value(topology.bucket(subjects.SANDBOX))
        assert {
            k: v for k, v in (await shared_bus.snapshot(js, topology.bucket(subjects.SANDBOX))).items()
        } == {
            "sb-1": b'{"old":1}',
            "sb-2": b'{"old":2}',
        }
        with pytest.raises(nats.js.errors.NotFoundError):
            await js.key_value(topology.legacy_bucket(subjects.SANDBOX))
        # A later start finds nothing to move and keeps what was written since.
        await new.put("sb-1", b'{"new":1}')
        await shared_bus.ensure_topology(js, topology)
        assert (await new.get("sb-1")).value == b'{"new":1}'
    finally:
        await nc.close()
