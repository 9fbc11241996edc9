"""Traces across services: OpenTelemetry spans, their context carried in NATS headers.

One trace follows one call through the services: an MCP tool call at the gateway, the
session command it sends the scheduler, the provisioning request the scheduler sends the
pool-manager, the execution request the executor answers, and the events appended on the
way. The W3C ``traceparent`` (and ``tracestate``) headers of OpenTelemetry's propagator
ride in the NATS headers of every request (:mod:`shared.infrastructure.beats` injects,
:mod:`shared.infrastructure.responders` extracts), every appended event and every
warm-pool offer.

Off unless configured (:class:`shared.infrastructure.settings.traces.TraceSettings`): then no SDK
is imported, no header is added, and every helper here returns at its first line (the
API's no-op tracer is not even asked). :func:`configure` installs an SDK tracer provider
with batched export at a service's start; tests :func:`install` their own.

What spans say is an allowlist (:func:`message_attributes`): ids (session, sandbox, job,
call, correlation, pool, organisation), the request's type, the responder, the subject,
exit and error codes. Never a command's text, a file's contents, a path or a credential;
an exception is recorded by its type or the product's error code, never its message.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import msgspec
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.util import types as otel_types

from sbx_api import errors
from shared.infrastructure.settings import service as service_settings

Attributes = dict[str, otel_types.AttributeValue]

INSTRUMENTATION = "cloud-agent-sandbox"
ERROR_CODE = "sbx.error_code"
_IDS = ("session_id", "sandbox_id", "job_id", "call_id", "correlation_id", "pool_id", "org_id")
"""Fields of requests and replies a span may carry (as ``sbx.<field>``)."""

_tracer: trace.Tracer | None = None
"""None: tracing is off (nothing configured)."""
_provider: Any = None
"""The SDK provider :func:`configure` made (flushed by :func:`shutdown`)."""
_OFF: contextlib.nullcontext[None] = contextlib.nullcontext()
_ours: contextvars.ContextVar[Span | None] = contextvars.ContextVar("sbx_span", default=None)
"""The innermost span made here: what :func:`annotate` and the others add to. (Not the
current span: a library's span may be current inside ours, fastmcp's ``tools/call``.)"""

CLIENT, SERVER, PRODUCER, CONSUMER, INTERNAL = (
    SpanKind.CLIENT,
    SpanKind.SERVER,
    SpanKind.PRODUCER,
    SpanKind.CONSUMER,
    SpanKind.INTERNAL,
)


# ---- what spans say (pure) ----------------------------------------------------------------


def tag(message: msgspec.Struct) -> str:
    """A request's type as the contract names it (``ensure_session``, ``shell``)."""
    config = type(message).__struct_config__
    return config.tag if isinstance(config.tag, str) else type(message).__name__.lower()


def operation(service: str, message: msgspec.Struct) -> str:
    """A request's span name: who answers it and what it is (``executor/shell``)."""
    return f"{service}/{tag(message)}"


def message_attributes(message: msgspec.Struct) -> Attributes:
    """What a span may say of a request: its type and its ids (an allowlist: a command's
    text, a file's contents or a path never)."""
    out: Attributes = {"sbx.request": tag(message)}
    for name in _IDS:
        value = getattr(message, name, None)
        if isinstance(value, str) and value:
            out[f"sbx.{name}"] = value
    org = getattr(getattr(message, "actor", None), "org_id", None)
    if isinstance(org, str) and org:
        out["sbx.org_id"] = org
    return out


def reply_attributes(reply: msgspec.Struct) -> Attributes:
    """What a span may say of a reply: the error's code, the sandbox a session got, a
    command's exit code or time-out (an allowlist: never output)."""
    out: Attributes = {}
    error = getattr(reply, "error", None)
    if getattr(reply, "ok", True) is False:
        out[ERROR_CODE] = getattr(error, "code", None) or "internal"
    for holder in ("session", "sandbox"):
        sandbox_id = getattr(getattr(reply, holder, None), "sandbox_id", None)
        if isinstance(sandbox_id, str):
            out["sbx.sandbox_id"] = sandbox_id
    exit_code = getattr(reply, "exit_code", None)
    if isinstance(exit_code, int):
        out["sbx.exit_code"] = exit_code
    if getattr(reply, "timed_out", False) is True:
        out["sbx.timed_out"] = True
    return out


def event_attributes(subject: str, appended: Sequence[msgspec.Struct]) -> Attributes:
    """What a span may say of events appended to ``subject``: their types, and the session
    they are of."""
    out: Attributes = {
        "messaging.system": "nats",
        "messaging.destination.name": subject,
        "sbx.events": [tag(event) for event in appended],
    }
    session = getattr(getattr(appended[0], "meta", None), "session_id", None) if appended else None
    if isinstance(session, str):
        out["sbx.session_id"] = session
    return out


def request_attributes(responder: str, subject: str) -> Attributes:
    """A request/reply exchange over NATS, by OpenTelemetry's messaging and RPC names."""
    return {
        "rpc.system": "nats",
        "rpc.service": responder,
        "messaging.system": "nats",
        "messaging.destination.name": subject,
    }


# ---- switching on ---------------------------------------------------------------------------


def enabled() -> bool:
    return _tracer is not None


def install(provider: trace.TracerProvider, *, globally: bool = True) -> None:
    """Trace through ``provider`` from now on. ``globally``: libraries' spans too (fastmcp's
    MCP spans); tests that share a process leave the global provider alone."""
    global _tracer
    _tracer = provider.get_tracer(INSTRUMENTATION)
    if globally:
        trace.set_tracer_provider(provider)


def uninstall() -> None:
    """Off again (tests)."""
    global _tracer
    _tracer = None


def configure(service: service_settings.ServiceSettings, version: str) -> None:
    """At a service's start: an SDK tracer provider exporting in batches where
    ``service.traces`` says, or nothing at all (no SDK imported) when it says nothing."""
    global _provider
    if not service.traces.enabled:
        return
    # Imported only here: a service with tracing off never loads the SDK.
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SpanExporter

    from shared.infrastructure import spanexport

    resource = Resource.create(
        {
            "service.name": service.service,
            "service.instance.id": service.instance,
            "service.namespace": service.bus.namespace,
            "service.version": version,
        }
    )
    provider = spanexport.provider(resource)
    for name in service.traces.exporters:
        exporter: SpanExporter
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter()  # endpoint, headers, timeout: OTEL_EXPORTER_OTLP_*
        else:
            exporter = ConsoleSpanExporter()
        provider.add_span_processor(spanexport.Batches(exporter, service.traces))
    _provider = provider
    install(provider)


def shutdown() -> None:
    """Export what is left (at a service's exit)."""
    global _provider
    if _provider is not None:
        with contextlib.suppress(Exception):
            _provider.shutdown()
        _provider = None
    uninstall()


# ---- headers --------------------------------------------------------------------------------


def inject(headers: dict[str, str]) -> dict[str, str]:
    """``headers`` with the current span's context added (as they were when tracing is off
    or no span is current)."""
    if _tracer is not None:
        propagate.inject(headers)
    return headers


def extract(headers: Mapping[str, str] | None) -> otel_context.Context | None:
    """The caller's context from a message's headers (None when tracing is off)."""
    if _tracer is None:
        return None
    return propagate.extract(headers or {})


# ---- spans ----------------------------------------------------------------------------------


def span(
    name: str,
    *,
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: Attributes | None = None,
    parent: otel_context.Context | None = None,
) -> contextlib.AbstractContextManager[Span | None]:
    """A span around a block, current inside it (nothing when tracing is off). An
    exception leaving the block marks it failed: the product's error code, or the
    exception's type; cancellation is said as such."""
    if _tracer is None:
        return _OFF
    return _span(_tracer, name, kind, attributes, parent)


def serving(
    headers: Mapping[str, str] | None, responder: str, subject: str
) -> contextlib.AbstractContextManager[Span | None]:
    """The server side of a request to ``responder`` on ``subject``: a span whose parent is
    the caller's (from ``headers``; a new trace when they carry none), named after the
    responder until :func:`describe` names the request."""
    if _tracer is None:
        return _OFF
    attributes = request_attributes(responder, subject)
    return _span(_tracer, responder, SpanKind.SERVER, attributes, propagate.extract(headers or {}))


def requesting(
    responder: str, subject: str, request: msgspec.Struct
) -> contextlib.AbstractContextManager[Span | None]:
    """The client side of a request to ``responder`` on ``subject``."""
    if _tracer is None:
        return _OFF
    attributes = {**request_attributes(responder, subject), **message_attributes(request)}
    return _span(_tracer, operation(responder, request), SpanKind.CLIENT, attributes, None)


def appending(
    name: str, subject: str, appended: Sequence[msgspec.Struct]
) -> contextlib.AbstractContextManager[Span | None]:
    """Events (or offers) published to a JetStream stream: what :func:`inject` adds to their
    headers inside is this span's context."""
    if _tracer is None:
        return _OFF
    return _span(_tracer, name, SpanKind.PRODUCER, event_attributes(subject, appended), None)


@contextlib.contextmanager
def _span(
    tracer: trace.Tracer,
    name: str,
    kind: SpanKind,
    attributes: Attributes | None,
    parent: otel_context.Context | None,
) -> Iterator[Span]:
    with tracer.start_as_current_span(
        name,
        context=parent,
        kind=kind,
        attributes=attributes,
        # Ours below: an exception's message may quote what a span must not carry.
        record_exception=False,
        set_status_on_exception=False,
    ) as current:
        token = _ours.set(current)
        try:
            yield current
        except errors.SandboxError as exc:
            _fail(current, exc.code)
            raise
        except Exception as exc:
            current.set_attribute("error.type", type(exc).__name__)
            current.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            raise
        except BaseException:  # cancelled: the caller went away or the service stops
            current.set_attribute("sbx.cancelled", True)
            raise
        finally:
            _ours.reset(token)


def _fail(current: Span, code: str) -> None:
    current.set_attributes({ERROR_CODE: code, "error.type": code})
    current.set_status(Status(StatusCode.ERROR, code))


def annotate(attributes: Attributes) -> None:
    """Add ``attributes`` to the current span."""
    if _tracer is not None:
        current = _ours.get()
        if current is not None and current.is_recording():
            current.set_attributes(attributes)


def failed(code: str) -> None:
    """Mark the current span failed with the product's error ``code``."""
    if _tracer is not None:
        current = _ours.get()
        if current is not None and current.is_recording():
            _fail(current, code)


def describe(responder: str, request: msgspec.Struct) -> None:
    """The current (server) span, now that its request is decoded: named after it, with
    its ids."""
    if _tracer is not None:
        current = _ours.get()
        if current is not None and current.is_recording():
            current.update_name(operation(responder, request))
            current.set_attributes(message_attributes(request))


def settle(reply: msgspec.Struct) -> None:
    """The current span, with what its reply says (an error reply marks it failed)."""
    if _tracer is not None:
        current = _ours.get()
        if current is not None and current.is_recording():
            said = reply_attributes(reply)
            code = said.pop(ERROR_CODE, None)
            current.set_attributes(said)
            if isinstance(code, str):
                _fail(current, code)


def link(headers: Mapping[str, str] | None) -> None:
    """Link the current span to the span that sent a message with ``headers`` (a warm-pool
    offer: made by the pool-manager's refill, taken in a session's claim)."""
    if _tracer is None or not headers:
        return
    current = _ours.get()
    sender = trace.get_current_span(propagate.extract(headers)).get_span_context()
    if current is not None and current.is_recording() and sender.is_valid:
        current.add_link(sender)


def log_ids(_: Any, __: str, event: dict[str, Any]) -> dict[str, Any]:
    """A structlog processor: the current trace and span ids on every log line written
    inside a span, so a log line leads to its trace."""
    if _tracer is not None:
        context = trace.get_current_span().get_span_context()
        if context.is_valid:
            event.setdefault("trace_id", format(context.trace_id, "032x"))
            event.setdefault("span_id", format(context.span_id, "016x"))
    return event
