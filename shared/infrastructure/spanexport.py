"""The OpenTelemetry SDK's side of tracing, made safe for a process that forks: a tracer
provider and a batch exporter that do nothing in a forked child.

The local runtime forks the service to run Python in the child (``nsmount``: a mount
into a sandbox; until the spawner, ``spawnd.py``, took it over, every command's entry
too), after the ``os.register_at_fork`` hooks. The SDK's ``BatchSpanProcessor`` starts
its export thread again there, and a process with a second thread may not join a user
namespace (the user namespace's holder once made it there too: every sandbox start
failed with "Exception occurred in preexec_fn"). Its ``TracerProvider``
detects its resource again there (with a thread pool). A child that execs at once needs
neither: :func:`provider` skips the detection and :class:`Batches` is the batch exporter,
without a fork hook (a child never exports what its parent queued). Imported only when tracing is configured
(:func:`shared.infrastructure.tracing.configure`).
"""

from __future__ import annotations

import collections
import os
import threading

import structlog
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter

from shared.infrastructure.settings import traces as traces_settings

log = structlog.get_logger(__name__)


class _Provider(TracerProvider):
    def _handle_fork(self) -> None:
        """(The SDK's hook after a fork: nothing here, see the module's docstring.)"""


def provider(resource: Resource | None = None) -> TracerProvider:
    """A tracer provider that runs no code in a forked child."""
    return _Provider(resource=resource) if resource is not None else _Provider()


class Batches(SpanProcessor):
    """Ended spans queued (at most ``max_queue``; the oldest dropped past it) and exported
    by one thread, every ``delay`` seconds or as soon as ``max_batch`` are waiting. Nothing
    runs in a forked child: the thread is the parent's, and a child's spans are not queued."""

    def __init__(self, exporter: SpanExporter, traces: traces_settings.TraceSettings) -> None:
        self._exporter = exporter
        self._delay, self._batch = traces.delay, traces.max_batch
        self._queue: collections.deque[ReadableSpan] = collections.deque(maxlen=traces.max_queue)
        self._wake = threading.Event()
        self._exporting = threading.Lock()
        self._pid = os.getpid()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="sbx-span-export", daemon=True)
        self._thread.start()

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        if self._stopped or os.getpid() != self._pid or not span.context.trace_flags.sampled:
            return
        self._queue.append(span)  # (thread-safe; a full queue drops its oldest)
        if len(self._queue) >= self._batch:
            self._wake.set()

    def _run(self) -> None:
        while not self._stopped:
            self._wake.wait(self._delay)
            self._wake.clear()
            self._export()

    def _export(self) -> None:
        with self._exporting:
            while self._queue:
                batch = [self._queue.popleft() for _ in range(min(self._batch, len(self._queue)))]
                try:
                    self._exporter.export(batch)
                except Exception as exc:  # the exporter logs its own failures; never the service's
                    log.warning("tracing.export_failed", error=type(exc).__name__, spans=len(batch))

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        if os.getpid() == self._pid:
            self._export()
        return True

    def shutdown(self) -> None:
        if self._stopped or os.getpid() != self._pid:
            return
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=5)
        self._export()
        self._exporter.shutdown()
