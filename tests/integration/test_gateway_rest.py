"""The REST session registry end to end: HTTP -> gateway -> NATS -> scheduler -> events -> KV,
with a real nats-server and both services running (in-process)."""

from __future__ import annotations

import httpx
import pytest

from sbx_api import hostapi
from services.gateway import app as gateway_app
from services.scheduler import app as scheduler_app
from shared.contract import ids, references, subjects
from shared.infrastructure.settings import gateway as gateway_settings
from tests import support

AUTH = {"Authorization": f"Bearer {support.API_KEY}"}
ALLOWED_ORIGIN = "https://console.example"


@pytest.fixture
async def api(nats_server, namespace):
    scheduler = await support.start_in_process(nats_server.url, namespace, "scheduler", scheduler_app.setup)
    base = support.service_settings(nats_server.url, namespace, "gateway")
    gw_settings = gateway_settings.GatewaySettings(
        base=base, api_key=support.API_KEY, host="127.0.0.1", port=0, cors_origins=(ALLOWED_ORIGIN,)
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


async def count_events(nats_server, namespace) -> int:
    nc, topology = await support.connect(nats_server.url, namespace)
    try:
        return len(await support.stream_events(nc, topology, subjects.SESSION))
    finally:
        await nc.close()


async def test_session_lifecycle_over_rest(api, nats_server, namespace):
    r = await api.post(
        "/v1/sessions",
        json={"session_id": "task-42", "image": "python:3.12"},
        headers={**AUTH, "X-Org-Id": "acme", "X-User-Id": "ann"},
    )
    assert r.status_code == 201, r.text
    assert r.headers["location"] == "/v1/sessions/task-42"
    body = r.json()
    assert body["status"] == "active" and body["org_id"] == "acme" and body["user_id"] == "ann"
    assert (await api.get("/v1/sessions/task-42", headers=AUTH)).json() == body

    assert (await api.post("/v1/sessions", json={"session_id": "task-42"}, headers=AUTH)).status_code == 409
    await api.post("/v1/sessions", json={"session_id": "other", "org_id": "globex"}, headers=AUTH)

    listed = (await api.get("/v1/sessions", headers=AUTH)).json()
    assert [s["session_id"] for s in listed["sessions"]] == ["task-42", "other"] and listed["count"] == 2
    only = (await api.get("/v1/sessions", params={"org_id": "globex"}, headers=AUTH)).json()
    assert [s["session_id"] for s in only["sessions"]] == ["other"]

    stopped = await api.post("/v1/sessions/task-42/stop", headers=AUTH)
    assert stopped.status_code == 200 and stopped.json()["status"] == "stopped"
    assert (await api.post("/v1/sessions/task-42/stop", headers=AUTH)).status_code == 200
    assert (await api.get("/v1/sessions", params={"status": "stopped"}, headers=AUTH)).json()["count"] == 1

    assert (await api.delete("/v1/sessions/task-42", headers=AUTH)).status_code == 204
    assert (await api.get("/v1/sessions/task-42", headers=AUTH)).status_code == 404
    assert (await api.delete("/v1/sessions/task-42", headers=AUTH)).status_code == 404
    assert (await api.get("/v1/sessions", params={"status": "deleted"}, headers=AUTH)).json()["count"] == 1

    # created, stopped, (other) created, deleted: four transitions, four events.
    assert await count_events(nats_server, namespace) == 4
    recreated = await api.post("/v1/sessions", json={"session_id": "task-42"}, headers=AUTH)
    assert recreated.status_code == 201 and recreated.json()["incarnation"] == 2


async def test_idempotency_key_makes_retries_safe(api, nats_server, namespace):
    headers = {**AUTH, "Idempotency-Key": "retry-me-1"}
    first = await api.post("/v1/sessions", json={"session_id": "idem"}, headers=headers)
    second = await api.post("/v1/sessions", json={"session_id": "idem"}, headers=headers)
    assert first.status_code == second.status_code == 201
    assert first.json() == second.json()
    assert await count_events(nats_server, namespace) == 1


@pytest.mark.parametrize(
    "authorization",
    [
        None,
        "Bearer wrong-key-0123456789abcdef",
        f"Bearer {support.API_KEY}x",
        f"Bearer {support.API_KEY[:-1]}",
        f"Bearer  {support.API_KEY}",
        f"Basic {support.API_KEY}",
        support.API_KEY,
        "Bearer",
    ],
)
async def test_every_endpoint_refuses_a_bad_key_before_doing_anything(
    api, nats_server, namespace, authorization
):
    headers = {"Authorization": authorization} if authorization is not None else {}
    calls = [
        ("POST", "/v1/sessions", {"session_id": "sneaky"}),
        ("GET", "/v1/sessions", None),
        ("GET", "/v1/sessions/sneaky", None),
        ("POST", "/v1/sessions/sneaky/stop", None),
        ("POST", "/v1/sessions/sneaky/pause", None),
        ("POST", "/v1/sessions/sneaky/resume", None),
        ("DELETE", "/v1/sessions/sneaky", None),
    ]
    for method, path, body in calls:
        r = await api.request(method, path, json=body, headers=headers)
        assert r.status_code == 401, (method, path, r.status_code)
        assert r.headers["www-authenticate"].startswith("Bearer")
        assert r.json()["error"] == "unauthorized"
        assert support.API_KEY not in r.text
    assert await count_events(nats_server, namespace) == 0


async def test_lower_case_scheme_is_accepted(api):
    r = await api.get("/v1/sessions", headers={"Authorization": f"bearer {support.API_KEY}"})
    assert r.status_code == 200


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (b"", "empty"),
        (b"{not json", "not valid JSON"),
        (b"[]", "Expected `object`"),
        (b'{"session_id": 42}', "Expected `str`"),
        (b'{"session_id": "a.b"}', "session_id"),
        (b'{"session_id": "a*"}', "session_id"),
        (b'{"session_id": ">"}', "session_id"),
        (b'{"session_id": "a b"}', "session_id"),
        (b'{"session_id": "a/b"}', "session_id"),
        (b'{"session_id": "a\\u0001"}', "session_id"),
        (b'{"session_id": "' + b"x" * 129 + b'"}', "session_id"),
        (b'{"session_id": "ok", "surprise": 1}', "surprise"),
        (b'{"session_id": "ok", "image": "$(rm -rf /)"}', "image"),
        (b'{"session_id": "ok", "org_id": "a\\nb"}', "org_id"),
        (b"{}", "session_id"),
    ],
)
async def test_bad_bodies_get_400_and_change_nothing(api, nats_server, namespace, body, fragment):
    r = await api.post("/v1/sessions", content=body, headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    problem = r.json()
    assert problem["error"] == "invalid_input" and fragment in problem["message"], problem
    assert await count_events(nats_server, namespace) == 0


@pytest.mark.parametrize("path_id", ["a.b", "a%2Fb", "%3E", "a*", "x" * 129, "a%00b", "a%20b"])
async def test_bad_ids_in_paths_get_400(api, nats_server, namespace, path_id):
    for method, path in [
        ("GET", f"/v1/sessions/{path_id}"),
        ("POST", f"/v1/sessions/{path_id}/stop"),
        ("POST", f"/v1/sessions/{path_id}/pause"),
        ("POST", f"/v1/sessions/{path_id}/resume"),
        ("DELETE", f"/v1/sessions/{path_id}"),
    ]:
        r = await api.request(method, path, headers=AUTH)
        assert r.status_code in (400, 404), (method, path, r.status_code)
        if r.status_code == 400:
            assert r.json()["error"] == "invalid_input"
    assert await count_events(nats_server, namespace) == 0


async def test_bad_query_and_headers(api):
    assert (await api.get("/v1/sessions", params={"limit": "0"}, headers=AUTH)).status_code == 400
    assert (await api.get("/v1/sessions", params={"status": "weird"}, headers=AUTH)).status_code == 400
    bad_key = await api.post(
        "/v1/sessions", json={"session_id": "k"}, headers={**AUTH, "Idempotency-Key": "a b"}
    )
    assert bad_key.status_code == 400


async def test_openapi_is_generated_from_the_types(api):
    r = await api.get("/openapi.json")  # public: documentation holds no secrets
    assert r.status_code == 200
    doc = r.json()
    assert doc["openapi"].startswith("3.")
    ops = {(path, method) for path, item in doc["paths"].items() for method in item}
    assert {
        ("/v1/sessions", "post"),
        ("/v1/sessions", "get"),
        ("/v1/sessions/{session_id}", "get"),
        ("/v1/sessions/{session_id}/stop", "post"),
        ("/v1/sessions/{session_id}/pause", "post"),
        ("/v1/sessions/{session_id}/resume", "post"),
        ("/v1/sessions/{session_id}", "delete"),
    } <= ops
    for action in ("pause", "resume"):
        documented = doc["paths"][f"/v1/sessions/{{session_id}}/{action}"]["post"]
        assert {"200", "400", "401", "404", "409", "501", "503", "504"} <= set(documented["responses"])
        assert "Idempotency-Key" in {p["name"] for p in documented["parameters"]}
    request = doc["components"]["schemas"]["CreateSessionRequest"]
    assert request["required"] == ["session_id"]
    assert request["properties"]["session_id"]["pattern"] == "^[A-Za-z0-9][A-Za-z0-9_-]*$"
    assert set(doc["components"]["schemas"]["Session"]["properties"]["status"]["enum"]) == {
        "active",
        "stopped",
        "deleted",
    }
    assert doc["components"]["securitySchemes"]["apiKey"]["scheme"] == "bearer"


async def test_no_scheduler_means_503_not_a_hang(nats_server, namespace):
    base = support.service_settings(nats_server.url, namespace, "gateway")
    gw = gateway_settings.GatewaySettings(base=base, api_key=support.API_KEY, host="127.0.0.1", port=0)
    gateway = await support.start_in_process(
        nats_server.url, namespace, "gateway", gateway_app.make_setup(gw), instance=base.instance
    )
    details = await support.wait_for_health(nats_server.url, namespace, "gateway", base.instance, key="url")
    async with httpx.AsyncClient(base_url=details["url"]) as client:
        r = await client.post("/v1/sessions", json={"session_id": "nobody-home"}, headers=AUTH)
    assert r.status_code == 503 and r.json()["retriable"] is True and r.headers["retry-after"]
    assert await gateway.stop() == 0


async def test_one_idempotency_key_on_two_sessions_creates_both(api, nats_server, namespace):
    """Keys are scoped to the session: reusing one on another id is a different request."""
    headers = {**AUTH, "Idempotency-Key": "shared-key"}
    assert (await api.post("/v1/sessions", json={"session_id": "first"}, headers=headers)).status_code == 201
    assert (await api.post("/v1/sessions", json={"session_id": "second"}, headers=headers)).status_code == 201
    assert await count_events(nats_server, namespace) == 2
    nc, topology = await support.connect(nats_server.url, namespace)
    try:
        from shared.infrastructure import replay

        assert not (await replay.verify(nc.jetstream(), topology)).differences
    finally:
        await nc.close()


async def test_one_idempotency_key_on_two_operations_does_both(api):
    """A key names one request to one operation: reused on a stop, then on a delete of the
    same session, the delete is done (it was answered 204 and nothing deleted)."""
    headers = {**AUTH, "Idempotency-Key": "one-key"}
    assert (await api.post("/v1/sessions", json={"session_id": "ops"}, headers=headers)).status_code == 201
    stopped = await api.post("/v1/sessions/ops/stop", headers=headers)
    assert stopped.status_code == 200 and stopped.json()["status"] == "stopped"
    assert (await api.delete("/v1/sessions/ops", headers=headers)).status_code == 204
    assert (await api.get("/v1/sessions/ops", headers=AUTH)).status_code == 404
    # ... and the same delete again is a retry: answered the same, nothing else done.
    assert (await api.delete("/v1/sessions/ops", headers=headers)).status_code == 204


async def test_browsers_preflights_and_401s_are_json_and_only_allowed_origins_get_cors(api):
    """A preflight carries no credentials: never a 401. An allowed origin (SBX_CORS_ORIGINS)
    gets CORS headers, and its real requests still need the key; any other origin's preflight
    is a JSON 403 saying why."""
    ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    allowed = await api.options("/v1/sessions", headers={"Origin": ALLOWED_ORIGIN, **ask})
    assert allowed.status_code == 200, allowed.text
    assert allowed.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    assert "authorization" in allowed.headers["access-control-allow-headers"].lower()
    for origin in ("https://evil.example", None):
        refused = await api.options("/v1/sessions", headers={**({"Origin": origin} if origin else {}), **ask})
        assert refused.status_code == 403 and "SBX_CORS_ORIGINS" in refused.json()["message"]
        assert "access-control-allow-origin" not in refused.headers
    keyless = await api.get("/v1/sessions", headers={"Origin": ALLOWED_ORIGIN})
    assert keyless.status_code == 401 and keyless.json()["retriable"] is False
    assert keyless.headers["access-control-allow-origin"] == ALLOWED_ORIGIN  # (so the page can read why)
    listed = await api.get("/v1/sessions", headers={"Origin": ALLOWED_ORIGIN, **AUTH})
    assert listed.status_code == 200 and listed.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    other = await api.get("/v1/sessions", headers={"Origin": "https://evil.example", **AUTH})
    assert other.status_code == 403 and "access-control-allow-origin" not in other.headers
    assert "SBX_ALLOWED_ORIGINS" in other.json()["message"]  # (a browser's page of another origin)
    mcp = await api.post("/mcp", json={})
    assert mcp.status_code == 401 and mcp.json() == {
        "error": "unauthorized",
        "message": "missing or invalid API key: send 'Authorization: Bearer <SANDBOX_API_KEY>'",
        "status": 401,
        "retriable": False,
    }


async def test_a_foreign_host_or_origin_is_refused_before_the_key_or_anything_else(
    api, nats_server, namespace
):
    """DNS rebinding and foreign pages (services/gateway/origins.py): 403 naming the setting on
    every surface, with or without a key, and nothing was done."""
    body = {"session_id": "rebound"}
    for foreign in ({"Origin": "http://evil.example"}, {"Host": "evil.example:8080"}):
        for auth in ({}, AUTH):
            for method, path in (("POST", "/mcp"), ("POST", "/v1/sessions"), ("GET", "/console/")):
                r = await api.request(method, path, json=body, headers={**foreign, **auth})
                assert r.status_code == 403, (foreign, method, path, r.text)
                assert r.json()["error"] == "forbidden"
                assert ("SBX_ALLOWED_ORIGINS" if "Origin" in foreign else "SBX_ALLOWED_HOSTS") in r.text
    assert await count_events(nats_server, namespace) == 0
    own = await api.post("/v1/sessions", json=body, headers={"Origin": "http://127.0.0.1:3000", **AUTH})
    assert own.status_code == 201, own.text


async def test_metrics_count_requests_by_route_template_and_show_the_process(api):
    """RED metrics by route template (a session id never becomes a label), the refused and
    the unrouted as ``other``; the Prometheus client's process and GC collectors."""
    from shared.infrastructure import metrics  # (the gateway runs in this process)

    labels = {"method": "GET", "route": "/v1/sessions/{session_id}", "status": "404"}
    before = metrics.REGISTRY.get_sample_value("sbx_http_requests_total", labels) or 0.0
    await api.get("/v1/sessions/never-made-1", headers=AUTH)
    await api.get("/v1/sessions/never-made-2", headers=AUTH)
    assert metrics.REGISTRY.get_sample_value("sbx_http_requests_total", labels) == before + 2
    await api.get("/v1/sessions")  # (no key)
    await api.request("BREW", "/v1/sessions", headers=AUTH)
    text = (await api.get("/metrics")).text
    assert 'sbx_http_requests_total{method="GET",route="other",status="401"}' in text
    assert 'method="OTHER"' in text and "BREW" not in text and "never-made" not in text
    assert 'sbx_http_request_seconds_count{method="GET",route="/v1/sessions/{session_id}"}' in text
    for standard in ("process_cpu_seconds_total", "process_resident_memory_bytes", "python_gc_objects"):
        assert standard in text, standard


async def test_unknown_routes_and_methods_answer_json(api):
    """Every status is a JSON problem: unknown routes 404, known routes with another method
    405 with an Allow header (the MCP endpoint keeps its own answers)."""
    missing = await api.get("/v2/nothing", headers=AUTH)
    assert missing.status_code == 404 and missing.json()["error"] == "not_found"
    assert "/v2/nothing" in missing.json()["message"]
    wrong = await api.request("PUT", "/v1/sessions", headers=AUTH)
    assert wrong.status_code == 405 and wrong.json()["error"] == "method_not_allowed"
    assert wrong.headers["allow"] == "GET, HEAD, POST"
    trace = await api.request("TRACE", "/healthz", headers=AUTH)
    assert trace.status_code == 405 and trace.json()["status"] == 405


async def test_the_openapi_document_states_the_rules_the_server_applies(api):
    doc = (await api.get("/openapi.json")).json()
    run = doc["paths"]["/v1/sessions/{session_id}/run"]["post"]
    params = {p["name"]: p["schema"] for p in run["parameters"]}
    assert params["session_id"]["pattern"] == ids.SESSION_ID_PATTERN
    assert {"409", "504"} <= set(run["responses"])
    stop = doc["paths"]["/v1/sessions/{session_id}/stop"]["post"]
    assert {p["name"]: p["schema"] for p in stop["parameters"]}["Idempotency-Key"]["pattern"] == (
        ids.IDEMPOTENCY_KEY_PATTERN
    )
    body = doc["components"]["schemas"]["RunBody"]["properties"]
    assert body["timeout"]["anyOf"][0] == {"exclusiveMinimum": 0, "maximum": 3600.0, "type": "number"}
    assert body["command"]["pattern"] and body["list_root"]["anyOf"][0]["pattern"] == hostapi.ROOT_PATTERN
    image = doc["components"]["schemas"]["CreateSessionRequest"]["properties"]["image"]["anyOf"][0]
    assert image["pattern"] == references.PATTERN and image["maxLength"] == references.MAX_LENGTH
    put = doc["paths"]["/v1/sessions/{session_id}/files/put"]["post"]["requestBody"]
    assert list(put["content"]) == [hostapi.MEDIA_TYPE]


async def test_pause_and_resume_check_the_session_before_anything(api, nats_server, namespace):
    """404 for an unknown session, 409 for one with no sandbox (created, never used; stopped),
    400 for a bad Idempotency-Key: and no event for any of them. (Pausing a sandbox for real:
    tests/e2e/test_pause.py.)"""
    for action in ("pause", "resume"):
        r = await api.post(f"/v1/sessions/nobody/{action}", headers=AUTH)
        assert r.status_code == 404 and r.json()["error"] == "not_found", r.text
    await api.post("/v1/sessions", json={"session_id": "unused"}, headers=AUTH)
    before = await count_events(nats_server, namespace)
    for action in ("pause", "resume"):
        r = await api.post(f"/v1/sessions/unused/{action}", headers=AUTH)
        assert r.status_code == 409 and r.json()["error"] == "conflict", r.text
        assert "has none yet" in r.json()["message"]
        r = await api.post(f"/v1/sessions/unused/{action}", headers={**AUTH, "Idempotency-Key": "a b"})
        assert r.status_code == 400 and r.json()["error"] == "invalid_input", r.text
    await api.post("/v1/sessions/unused/stop", headers=AUTH)
    r = await api.post("/v1/sessions/unused/pause", headers=AUTH)
    assert r.status_code == 409 and "stopped" in r.json()["message"]
    assert await count_events(nats_server, namespace) == before + 1  # the stop only
