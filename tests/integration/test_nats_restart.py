"""NATS itself restarted on its file store: events and projections survive, and running
services reconnect and keep working without being restarted."""

from __future__ import annotations

import httpx
import pytest

from services.gateway import app as gateway_app
from services.scheduler import app as scheduler_app
from shared.contract import subjects
from shared.infrastructure import replay
from shared.infrastructure.settings import gateway as gateway_settings
from tests import support

pytestmark = pytest.mark.slow
AUTH = {"Authorization": f"Bearer {support.API_KEY}"}


async def test_state_survives_a_nats_restart(tmp_path, namespace):
    server = support.NatsServer(store=tmp_path / "store")
    server.start()
    try:
        scheduler = await support.start_in_process(server.url, namespace, "scheduler", scheduler_app.setup)
        base = support.service_settings(server.url, namespace, "gateway")
        gw = gateway_settings.GatewaySettings(base=base, api_key=support.API_KEY, host="127.0.0.1", port=0)
        gateway = await support.start_in_process(
            server.url, namespace, "gateway", gateway_app.make_setup(gw), instance=base.instance
        )
        url = (await support.wait_for_health(server.url, namespace, "gateway", base.instance, key="url"))[
            "url"
        ]
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            for n in range(5):
                r = await client.post("/v1/sessions", json={"session_id": f"keep-{n}"}, headers=AUTH)
                assert r.status_code == 201
            await client.post("/v1/sessions/keep-0/stop", headers=AUTH)

            server.stop()
            server.start()  # same port, same store

            async def listed() -> bool:
                r = await client.get("/v1/sessions", headers=AUTH)
                return r.status_code == 200 and r.json()["count"] == 5

            await support.eventually(listed, timeout=20)
            assert (await client.get("/v1/sessions/keep-0", headers=AUTH)).json()["status"] == "stopped"

            async def accepts_writes() -> bool:
                r = await client.post(
                    "/v1/sessions",
                    json={"session_id": "after"},
                    headers={**AUTH, "Idempotency-Key": "after-restart"},
                )
                return r.status_code == 201

            await support.eventually(accepts_writes, timeout=20)

        nc, topology = await support.connect(server.url, namespace)
        try:
            history = await support.stream_events(nc, topology, subjects.SESSION)
            assert len(history) == 7  # five created, one stopped, one created after the restart
            assert not (await replay.verify(nc.jetstream(), topology)).differences
        finally:
            await nc.close()
        assert await gateway.stop() == 0
        assert await scheduler.stop() == 0
    finally:
        server.stop()
