"""Session lists over REST with a real nats-server, gateway and scheduler: filters, paging
that holds while sessions are created and deleted, cursors that cannot be altered or
carried to another organisation, and org-bound keys that list only their own."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from services.gateway import app as gateway_app
from services.scheduler import app as scheduler_app
from shared.infrastructure.settings import gateway as gateway_settings
from tests import support

AUTH = {"Authorization": f"Bearer {support.API_KEY}"}
ACME_KEY, GLOBEX_KEY = "acme-key-0123456789abcdef", "globex-key-0123456789abcdef"
ACME = {"Authorization": f"Bearer {ACME_KEY}"}
GLOBEX = {"Authorization": f"Bearer {GLOBEX_KEY}"}


@pytest.fixture
async def api(nats_server, namespace):
    scheduler = await support.start_in_process(nats_server.url, namespace, "scheduler", scheduler_app.setup)
    base = support.service_settings(nats_server.url, namespace, "gateway")
    gw_settings = gateway_settings.GatewaySettings(
        base=base,
        api_key=support.API_KEY,
        host="127.0.0.1",
        port=0,
        org_keys=(("acme", ACME_KEY), ("globex", GLOBEX_KEY)),
    )
    gateway = await support.start_in_process(
        nats_server.url, namespace, "gateway", gateway_app.make_setup(gw_settings), instance=base.instance
    )
    details = await support.wait_for_health(nats_server.url, namespace, "gateway", base.instance, key="url")
    async with httpx.AsyncClient(base_url=details["url"], timeout=10) as client:
        yield client
    assert await gateway.stop() == 0
    if not scheduler.task.done():
        await scheduler.stop()


async def create(api, session_id: str, headers=AUTH, **body) -> None:
    r = await api.post("/v1/sessions", json={"session_id": session_id, **body}, headers=headers)
    assert r.status_code == 201, r.text


async def ids_of(api, headers=AUTH, **params) -> tuple[list[str], int]:
    body = (await api.get("/v1/sessions", params=params, headers=headers)).json()
    return [s["session_id"] for s in body["sessions"]], body["count"]


async def test_filters_by_status_org_user_and_image(api):
    await create(api, "a1", org_id="acme", user_id="ann", image="python:3.12")
    await create(api, "a2", org_id="acme", user_id="bob")
    await create(api, "g1", org_id="globex", user_id="ann", image="python:3.12")
    assert (await api.post("/v1/sessions/a2/stop", headers=AUTH)).status_code == 200
    assert (await api.delete("/v1/sessions/g1", headers=AUTH)).status_code == 204
    assert await ids_of(api) == (["a1", "a2"], 2)
    assert await ids_of(api, status="active") == (["a1"], 1)
    assert await ids_of(api, status="stopped") == (["a2"], 1)
    assert await ids_of(api, status="deleted") == (["g1"], 1)
    assert await ids_of(api, org_id="acme", user_id="bob") == (["a2"], 1)
    assert await ids_of(api, image="python:3.12") == (["a1"], 1)
    assert await ids_of(api, image="python:3.12", status="deleted") == (["g1"], 1)
    assert await ids_of(api, user_id="ann", org_id="globex") == ([], 0)
    r = await api.get("/v1/sessions", params={"status": "paused"}, headers=AUTH)
    assert r.status_code == 400 and "status must be one of" in r.json()["message"]


async def test_paging_holds_while_sessions_are_created_and_deleted(api):
    for n in range(12):
        await create(api, f"p{n:02d}")
    first = (await api.get("/v1/sessions", params={"limit": 5}, headers=AUTH)).json()
    assert [s["session_id"] for s in first["sessions"]] == [f"p{n:02d}" for n in range(5)]
    assert first["count"] == 12 and first["next_cursor"]
    # the boundary item, one later item and one already shown go; two new ones come
    for gone in ("p04", "p07", "p01"):
        assert (await api.delete(f"/v1/sessions/{gone}", headers=AUTH)).status_code == 204
    await create(api, "p12")
    await create(api, "p13")
    seen, cursor = [], first["next_cursor"]
    while cursor:
        page = (await api.get("/v1/sessions", params={"limit": 5, "cursor": cursor}, headers=AUTH)).json()
        seen.extend(s["session_id"] for s in page["sessions"])
        cursor = page["next_cursor"]
    assert seen == [f"p{n:02d}" for n in range(5, 14) if n != 7]


async def test_an_altered_cursor_or_one_sent_with_other_filters_is_a_400(api):
    for n in range(4):
        await create(api, f"c{n}")
    cursor = (await api.get("/v1/sessions", params={"limit": 2}, headers=AUTH)).json()["next_cursor"]
    for params in (
        {"cursor": cursor[:-2] + ("AA" if not cursor.endswith("AA") else "BB")},
        {"cursor": "not-a-cursor"},
        {"cursor": cursor, "status": "stopped"},
        {"cursor": cursor, "image": "python:3.12"},
    ):
        r = await api.get("/v1/sessions", params=params, headers=AUTH)
        assert r.status_code == 400, params
        assert r.json()["message"].startswith("cursor is not one this API returned")


async def test_an_org_key_lists_only_its_own_and_its_cursor_does_not_reach_another_org(api):
    for n in range(3):
        await create(api, f"acme-{n}", ACME)
        await create(api, f"globex-{n}", GLOBEX)
    await create(api, "nobody")
    assert await ids_of(api, ACME) == ([f"acme-{n}" for n in range(3)], 3)
    r = await api.get("/v1/sessions", params={"org_id": "globex"}, headers=ACME)
    assert r.status_code == 403
    acme_cursor = (await api.get("/v1/sessions", params={"limit": 1}, headers=ACME)).json()["next_cursor"]
    r = await api.get("/v1/sessions", params={"limit": 1, "cursor": acme_cursor}, headers=GLOBEX)
    assert r.status_code == 400  # bound to acme's query: never a page of globex's or anyone's
    unbound = (await api.get("/v1/sessions", params={"limit": 1}, headers=AUTH)).json()["next_cursor"]
    r = await api.get("/v1/sessions", params={"limit": 1, "cursor": unbound}, headers=ACME)
    assert r.status_code == 400
    page = (await api.get("/v1/sessions", params={"limit": 1, "cursor": acme_cursor}, headers=ACME)).json()
    assert [s["session_id"] for s in page["sessions"]] == ["acme-1"]


async def test_a_list_right_after_a_write_shows_it(api):
    for n in range(5):
        await create(api, f"ryw{n}")
        assert await ids_of(api) == ([f"ryw{n}"], 1)
        assert (await api.delete(f"/v1/sessions/ryw{n}", headers=AUTH)).status_code == 204
        assert (await ids_of(api, status="deleted"))[1] == n + 1


async def test_the_python_client_walks_the_pages_with_filters(api):
    from sbx_client import rest as client_rest

    for n in range(7):
        await create(api, f"py{n}", image="node:22" if n % 2 else None)
    client = client_rest.Client(str(api.base_url), support.API_KEY, env={})

    def walk() -> list[str]:
        seen, cursor = [], None
        while True:
            page = client.list_sessions(image="node:22", limit=2, cursor=cursor)
            assert page.count == 3
            seen += [s.session_id for s in page.sessions]
            if page.next_cursor is None:
                return seen
            cursor = page.next_cursor

    assert await asyncio.to_thread(walk) == ["py1", "py3", "py5"]
