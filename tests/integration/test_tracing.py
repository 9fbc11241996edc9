"""One MCP tool call, one trace: the gateway's, the scheduler's, the pool-manager's and the
executor's spans joined by the trace context the NATS headers carry.

The four services run in this process (over a real nats-server, with real sandboxes) and
share one SDK tracer provider whose spans go to an in-memory exporter; the agent is
fastmcp's MCP client over streamable HTTP. Each service's spans are told apart by what
only that service records: the gateway's tool span, and each responder's server span
(``rpc.service``). That every server span's parent is the caller's client span, and that
no span of the session is in another trace, is what proves the propagation.
"""

from __future__ import annotations

import fastmcp
import pytest
from fastmcp.client.transports import StreamableHttpTransport
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from services.executor import app as executor_app
from services.gateway import app as gateway_app
from services.pool_manager import app as pool_app
from services.scheduler import app as scheduler_app
from shared.infrastructure import spanexport, tracing
from shared.infrastructure.settings import gateway as gateway_settings
from shared.infrastructure.settings import runtime as runtime_settings
from tests import support

pytestmark = [pytest.mark.needs_root("the local runtime needs root"), pytest.mark.slow]
RUNTIME = runtime_settings.RuntimeSettings(memory_bytes=512 * 1024**2, output_limit=4096)
SECRET = "do-not-trace-this-4f1c"


@pytest.fixture
def exporter():
    provider = spanexport.provider()  # (as a configured service's: nothing runs in a forked child)
    memory = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracing.install(provider, globally=False)  # (other tests in this process stay untraced)
    yield memory
    tracing.uninstall()
    provider.shutdown()


@pytest.fixture
async def gateway_url(exporter, nats_server, namespace, tmp_path):
    state = tmp_path / "state"
    running = [
        await support.start_in_process(
            nats_server.url, namespace, "scheduler", scheduler_app.setup, state_dir=state
        ),
        await support.start_in_process(
            nats_server.url, namespace, "pool-manager", pool_app.make_setup(RUNTIME), state_dir=state
        ),
        await support.start_in_process(
            nats_server.url, namespace, "executor", executor_app.make_setup(RUNTIME), state_dir=state
        ),
    ]
    base = support.service_settings(nats_server.url, namespace, "gateway", state_dir=state)
    gateway = gateway_settings.GatewaySettings(
        # Claimed on the first tool call, not on connecting: then that call's trace holds it all.
        base=base,
        api_key=support.API_KEY,
        host="127.0.0.1",
        port=0,
        claim_on_connect=False,
    )
    running.append(
        await support.start_in_process(
            nats_server.url,
            namespace,
            "gateway",
            gateway_app.make_setup(gateway),
            instance=base.instance,
            state_dir=state,
        )
    )
    details = await support.wait_for_health(nats_server.url, namespace, "gateway", base.instance, key="url")
    yield details["url"]
    for r in reversed(running):
        await r.stop()
    from shared.runtime.local import runtime as local

    rt = local.LocalRuntime(state)
    for info in await rt.list():
        await rt.delete(info.sandbox_id)
    rt.caches.detach_all()


async def call(url: str, session: str, tool: str, arguments: dict) -> fastmcp.client.CallToolResult:
    headers = {"Authorization": f"Bearer {support.API_KEY}", "X-Session-Id": session}
    async with fastmcp.Client(StreamableHttpTransport(f"{url}/mcp", headers=headers)) as client:
        return await client.call_tool(tool, arguments, raise_on_error=False)


def tool_span(spans: list[ReadableSpan], name: str, session: str) -> ReadableSpan:
    [span] = [s for s in spans if s.name == name and (s.attributes or {}).get("sbx.session_id") == session]
    return span


async def trace_of(exporter: InMemorySpanExporter, root: ReadableSpan, last: str) -> list[ReadableSpan]:
    """Every span of ``root``'s trace, once the span named ``last`` has ended (a responder
    ends its span after its reply left)."""

    def spans() -> list[ReadableSpan]:
        return [s for s in exporter.get_finished_spans() if s.context.trace_id == root.context.trace_id]

    await support.eventually(lambda: any(s.name == last and s.kind == SpanKind.SERVER for s in spans()))
    return spans()


async def test_one_shell_call_is_one_trace_across_the_services(gateway_url, exporter):
    session = "traced-1"
    result = await call(gateway_url, session, "shell", {"command": f"echo {SECRET}"})
    assert not result.is_error, result.content

    root = tool_span(exporter.get_finished_spans(), "gateway/shell", session)
    spans = await trace_of(exporter, root, "executor/shell")
    assert root.parent is None or not root.parent.is_remote  # the trace starts at the gateway
    assert root.attributes["sbx.tool"] == "shell"
    sandbox = root.attributes["sbx.sandbox_id"]

    servers = {s.name: s for s in spans if s.kind == SpanKind.SERVER}
    clients = {s.name: s for s in spans if s.kind == SpanKind.CLIENT}
    # A new session: the scheduler creates it with a cold sandbox the pool-manager
    # provisions; the executor runs the command.
    assert {"scheduler/session.ensure", "pool-manager/provision", "executor/shell"} <= servers.keys()
    responders = {server.attributes["rpc.service"] for server in servers.values()}
    assert responders >= {"scheduler", "pool-manager", "executor"}
    by_id = {s.context.span_id: s for s in spans}
    for name, server in servers.items():
        # Each responder's span continues its caller's client span, from the NATS headers.
        assert server.parent is not None and server.parent.is_remote, name
        assert server.parent.span_id == clients[name].context.span_id, name
    assert by_id[clients["scheduler/session.ensure"].parent.span_id] is root
    assert by_id[clients["executor/shell"].parent.span_id] is root
    assert by_id[clients["pool-manager/provision"].parent.span_id] is servers["scheduler/session.ensure"]

    executor = servers["executor/shell"]
    assert executor.attributes["sbx.session_id"] == session
    assert executor.attributes["sbx.sandbox_id"] == sandbox
    assert executor.attributes["sbx.exit_code"] == 0
    assert servers["scheduler/session.ensure"].attributes["sbx.sandbox_id"] == sandbox
    appended = [s for s in spans if s.name == "events.append"]
    assert {e for s in appended for e in s.attributes["sbx.events"]} >= {"session.created", "sandbox.started"}
    assert all(s.status.status_code != StatusCode.ERROR for s in spans if s.name != "events.append")

    # No span of this session is in another trace; none carries the command's text.
    everything = exporter.get_finished_spans()
    of_session = [s for s in everything if (s.attributes or {}).get("sbx.session_id") == session]
    assert {s.context.trace_id for s in of_session} == {root.context.trace_id}
    assert not [s.name for s in everything if SECRET in repr(dict(s.attributes or {})) + s.name]


async def test_a_failed_call_says_its_error_code(gateway_url, exporter):
    session = "traced-2"
    result = await call(gateway_url, session, "shell_poll", {"job_id": "0" * 32})
    assert result.is_error

    root = tool_span(exporter.get_finished_spans(), "gateway/shell_poll", session)
    spans = await trace_of(exporter, root, "executor/shell_poll")
    executor = next(s for s in spans if s.name == "executor/shell_poll" and s.kind == SpanKind.SERVER)
    for span in (root, executor):
        assert span.attributes["sbx.error_code"] == "not_found"
        assert span.status.status_code == StatusCode.ERROR
