"""Every service process takes part in the event model: instance.started on start,
instance.stopped after a clean drain, and a fixed SBX_INSTANCE_ID can start again."""

from __future__ import annotations

from shared.contract import events, subjects
from shared.domain import projections
from shared.infrastructure import eventstore, projector, service
from tests import support


async def test_a_service_joins_reports_and_leaves_and_can_come_back(nats_server, namespace, bus):
    """The proxy-scaler with sandbox egress off: nothing to scale, so only its lifecycle runs
    (and its health says why)."""
    from services.proxy_scaler import app as scaler_app
    from shared.infrastructure.settings import proxies, runtime

    nc, topology = bus
    name = "proxy-scaler"
    setup = scaler_app.make_setup(runtime.RuntimeSettings(egress="none"), proxies.ProxySettings())
    running = await support.start_in_process(
        nats_server.url, namespace, name, setup, instance=f"{name}-fixed"
    )
    details = await support.wait_for_health(nats_server.url, namespace, name, f"{name}-fixed")
    assert details["fleet"].startswith("off")
    assert await running.stop() == 0

    # Same instance id again (as a Deployment with a stable pod name would do).
    again = await support.start_in_process(nats_server.url, namespace, name, setup, instance=f"{name}-fixed")
    assert await again.stop() == 0

    history = await support.stream_events(nc, topology, subjects.INSTANCE)
    assert [type(s.event) for s in history] == [
        events.InstanceStarted,
        events.InstanceStopped,
        events.InstanceStarted,
        events.InstanceStopped,
    ]
    assert {s.event.service for s in history} == {name}
    js = nc.jetstream()
    instances = await projector.ProjectionStore.open(
        js, projections.INSTANCES, eventstore.EventStore(js, topology)
    )
    state = await instances.get(f"{name}-fixed")
    assert (
        state.status == "stopped" and state.version == service.VERSION and state.last_seq == history[-1].seq
    )
    from shared.infrastructure import health

    assert not [r for r in await health.read_all(js, topology.health_bucket) if r.service == name]
