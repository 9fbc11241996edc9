"""Tracing's rules without NATS: when it is on, what spans may say, and how a span's context
crosses a message's headers (shared/infrastructure/tracing.py). The trace of a real tool
call across the services is tests/integration/test_tracing.py."""

from __future__ import annotations

import subprocess
import sys
from datetime import UTC, datetime

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from sbx_api import errors
from shared.contract import commands, execution, provisioning, states
from shared.infrastructure import processenv, spanexport, tracing
from shared.infrastructure.settings import service
from shared.infrastructure.settings import traces as traces_settings
from tests import support


@pytest.fixture
def exporter():
    # (the SDK's own TracerProvider runs a thread pool in every forked child, which makes the
    # local runtime's sandbox starts fail in integration tests of this same process)
    provider = spanexport.provider()
    memory = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracing.install(provider, globally=False)
    yield memory
    tracing.uninstall()
    provider.shutdown()


@pytest.mark.parametrize(
    ("env", "exporters"),
    [
        ({}, ()),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, ("otlp",)),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, ("otlp",)),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, ("otlp",)),
        ({"OTEL_TRACES_EXPORTER": " Console , otlp,console"}, ("console", "otlp")),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, ()),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, ()),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}, ("otlp",)),
    ],
)
def test_traces_are_on_only_when_configured(env, exporters):
    traces = traces_settings.TraceSettings.from_env(env)
    assert traces.exporters == exporters and traces.enabled == bool(exporters)
    assert service.ServiceSettings.from_env("scheduler", env).traces == traces


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "zipkin"),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "grpc"),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"},
            "grpc",
        ),
    ],
)
def test_what_cannot_be_had_stops_the_start_with_its_name(env, named):
    with pytest.raises(errors.ConfigError, match=named):
        traces_settings.TraceSettings.from_env(env)


def test_spans_carry_ids_never_a_commands_text_or_a_files_contents():
    actor = commands.Actor(via="mcp", org_id="acme", user_id="ann@example.com")
    shell = execution.Shell(
        session_id="s1", sandbox_id="sb-1", command="echo $TOKEN", actor=actor, call_id="c" * 32
    )
    assert tracing.message_attributes(shell) == {
        "sbx.request": "shell",
        "sbx.session_id": "s1",
        "sbx.sandbox_id": "sb-1",
        "sbx.call_id": "c" * 32,
        "sbx.org_id": "acme",
    }
    edit = execution.Edit(
        session_id="s1", sandbox_id="sb-1", command="create", path="/workspace/.env", file_text="KEY=v"
    )
    said = repr(tracing.message_attributes(edit))
    assert "KEY=v" not in said and ".env" not in said and "ann@" not in said
    assert tracing.operation("executor", shell) == "executor/shell"
    assert tracing.tag(execution.Prepare(sandbox_id="sb-1")) == "prepare"


def test_a_reply_says_its_error_code_sandbox_and_exit_code_never_its_output():
    failed = execution.Reply(ok=False, error=commands.ErrorInfo("not_found", "no job /secret/path"))
    assert tracing.reply_attributes(failed) == {tracing.ERROR_CODE: "not_found"}
    ran = execution.Reply(ok=True, output="TOKEN=abc", exit_code=3, timed_out=True)
    assert tracing.reply_attributes(ran) == {"sbx.exit_code": 3, "sbx.timed_out": True}
    now = datetime.now(UTC)
    sandbox = states.SandboxState(
        sandbox_id="sb-9", status="running", created_at=now, updated_at=now, last_seq=1
    )
    assert tracing.reply_attributes(commands.CommandReply(ok=True)) == {}
    assert tracing.reply_attributes(provisioning.PoolReply(ok=True, sandbox=sandbox)) == {
        "sbx.sandbox_id": "sb-9"
    }


def test_the_batch_exporters_settings_come_from_the_sdks_variables():
    default = traces_settings.TraceSettings.from_env({"OTEL_TRACES_EXPORTER": "otlp"})
    assert (default.delay, default.max_queue, default.max_batch) == (5.0, 2048, 512)
    tuned = traces_settings.TraceSettings.from_env(
        {
            "OTEL_BSP_SCHEDULE_DELAY": "250",
            "OTEL_BSP_MAX_QUEUE_SIZE": "100",
            "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "10",
        }
    )
    assert (tuned.delay, tuned.max_queue, tuned.max_batch) == (0.25, 100, 10)
    assert traces_settings.TraceSettings.from_env({"OTEL_BSP_MAX_QUEUE_SIZE": "100"}).max_batch == 100
    with pytest.raises(errors.ConfigError, match="OTEL_BSP_MAX_EXPORT_BATCH_SIZE"):
        traces_settings.TraceSettings.from_env(
            {"OTEL_BSP_MAX_QUEUE_SIZE": "10", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "11"}
        )


def test_ended_spans_are_exported_in_batches():
    memory = InMemorySpanExporter()
    batches = spanexport.Batches(memory, traces_settings.TraceSettings(delay=3600, max_queue=3, max_batch=2))
    provider = spanexport.provider()
    provider.add_span_processor(batches)
    tracer = provider.get_tracer("test")
    for name in "abcd":
        tracer.start_span(name).end()
    batches.force_flush()
    # (at most max_queue wait: the oldest was dropped)
    assert [s.name for s in memory.get_finished_spans()] == ["b", "c", "d"]
    provider.shutdown()


def test_off_nothing_is_added_to_headers_and_no_span_is_made():
    assert not tracing.enabled()
    headers = {"Nats-Msg-Id": "x"}
    assert tracing.inject(headers) == {"Nats-Msg-Id": "x"}
    assert tracing.extract({"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}) is None
    with tracing.span("nothing") as span:
        assert span is None
        tracing.annotate({"sbx.tool": "shell"})
        tracing.failed("internal")


def test_a_spans_context_crosses_headers_and_continues_on_the_other_side(exporter):
    shell = execution.Shell(session_id="s1", sandbox_id="sb-1", command="true")
    with tracing.requesting("executor", "sbx.exec", shell):
        headers = tracing.inject({"Sbx-Beat": "0.5"})
    assert headers["Sbx-Beat"] == "0.5" and headers["traceparent"].startswith("00-")
    with tracing.serving(headers, "executor", "sbx.exec"):
        tracing.describe("executor", shell)
        tracing.settle(execution.Reply(ok=False, error=commands.ErrorInfo("timeout", "slow")))
    client, server = exporter.get_finished_spans()
    assert (client.kind, server.kind) == (SpanKind.CLIENT, SpanKind.SERVER)
    assert client.name == server.name == "executor/shell"
    assert server.context.trace_id == client.context.trace_id
    assert server.parent is not None and server.parent.span_id == client.context.span_id
    assert server.parent.is_remote
    assert server.attributes["sbx.error_code"] == "timeout" and server.status.status_code == StatusCode.ERROR
    assert server.attributes["rpc.service"] == "executor"


def test_a_request_without_trace_headers_starts_a_trace_of_its_own(exporter):
    with tracing.serving({"Sbx-Beat": "0.5"}, "scheduler", "sbx.cmd.session"):
        pass
    [span] = exporter.get_finished_spans()
    assert span.parent is None and span.name == "scheduler"


def test_an_exception_is_recorded_by_code_or_type_never_by_message(exporter):
    with pytest.raises(errors.NotFound), tracing.span("a"):
        raise errors.NotFound("no such file /workspace/secret.txt")
    with pytest.raises(ValueError), tracing.span("b"):
        raise ValueError("TOKEN=abc")
    a, b = exporter.get_finished_spans()
    assert a.attributes["sbx.error_code"] == "not_found" and a.status.description == "not_found"
    assert b.attributes["error.type"] == "ValueError" and b.status.description == "ValueError"
    assert not a.events and not b.events  # no exception event: its message may quote anything


def test_annotations_go_to_our_innermost_span_and_log_lines_get_its_ids(exporter):
    with tracing.span("outer") as outer:
        with tracing.span("inner"):
            tracing.annotate({"sbx.sandbox_id": "sb-1"})
        tracing.failed("conflict")
        line = tracing.log_ids(None, "info", {"event": "x"})
    inner, outer_done = exporter.get_finished_spans()
    assert inner.attributes["sbx.sandbox_id"] == "sb-1" and "sbx.error_code" not in inner.attributes
    assert outer_done.attributes["sbx.error_code"] == "conflict"
    assert line["trace_id"] == format(outer.get_span_context().trace_id, "032x")
    assert "trace_id" not in tracing.log_ids(None, "info", {"event": "y"})


def test_the_services_get_the_otel_variables_and_sandboxes_do_not():
    shell = {
        "PATH": "/usr/bin",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
        "OTEL_TRACES_EXPORTER": "otlp",
    }
    assert processenv.service(shell)["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://c:4318"
    assert "OTEL_TRACES_EXPORTER" not in processenv.system(shell)


CONFIGURE = """
import sys
from opentelemetry import trace
from services.gateway import app
from shared.infrastructure import service, tracing
from shared.infrastructure.settings import service
from shared.infrastructure.settings import traces as traces_settings
env = dict(a.split("=", 1) for a in sys.argv[1:])
tracing.configure(service.ServiceSettings.from_env("scheduler", env), "1.2")
provider = trace.get_tracer_provider()
print(tracing.enabled(), "opentelemetry.sdk" in sys.modules, type(provider).__name__)
if tracing.enabled():
    print(provider.resource.attributes["service.name"], provider.resource.attributes["service.instance.id"])
tracing.shutdown()
"""


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ([], ["False False ProxyTracerProvider"]),
        (
            ["OTEL_TRACES_EXPORTER=otlp", "SBX_INSTANCE_ID=scheduler-7"],
            ["True True _Provider", "scheduler scheduler-7"],
        ),
    ],
)
def test_a_service_with_nothing_configured_loads_no_sdk(env, expected):
    out = subprocess.run(
        [sys.executable, "-c", CONFIGURE, *env], cwd=support.ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.splitlines() == expected


FORK = """
import os, subprocess, sys
from shared.infrastructure import tracing
from shared.infrastructure.settings import service
from shared.infrastructure.settings import traces as traces_settings
tracing.configure(service.ServiceSettings.from_env("pool-manager", {"OTEL_TRACES_EXPORTER": "console"}), "1")
with tracing.span("queued"):
    pass
seen = set()
for _ in range(50):  # (the SDK's provider left a second thread in about half of them)
    r, w = os.pipe()
    def child():  # what the local runtime's preexec_fn sees: unshare(CLONE_NEWUSER) needs one thread
        os.write(w, str(len(os.listdir("/proc/self/task"))).encode())
    subprocess.run(["true"], preexec_fn=child)
    seen.add(os.read(r, 10).decode())
    os.close(r), os.close(w)
print("threads in the child:", *sorted(seen), file=sys.stderr)
"""


def test_a_traced_service_forks_children_with_one_thread():
    """The SDK's own batch exporter restarts its thread in every forked child, and its tracer
    provider runs a thread pool there, where the local runtime's ``preexec_fn`` then cannot
    make the sandbox's user namespace (shared/infrastructure/spanexport.py)."""
    out = subprocess.run([sys.executable, "-c", FORK], cwd=support.ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "threads in the child: 1\n" in out.stderr
    assert '"name": "queued"' in out.stdout  # exported (to stdout) at the exit
