"""Structured logs: one JSON object a line on stderr (or readable console lines).

Every line carries ``service`` and ``instance``. Secrets are never passed to a
logger; as a second line of defence any key named like a secret is redacted.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog

from shared.infrastructure import tracing

_SECRET_KEYS = ("api_key", "authorization", "token", "password", "secret")
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def _redact(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    for key in list(event):
        if any(secret in key.lower() for secret in _SECRET_KEYS):
            event[key] = "[redacted]"
    return event


def configure(*, service: str, instance: str, level: str = "info", fmt: str = "json") -> None:
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )

    def identify(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        # (set on every line, from any thread: context variables do not reach threads)
        event.setdefault("service", service)
        event.setdefault("instance", instance)
        return event

    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        identify,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        tracing.log_ids,
        _redact,
    ]
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service, instance=instance)
    # Every library that logs through the standard library (uvicorn, nats, mcp, fastmcp,
    # httpx) goes through the same processors: one JSON object a line, with its logger name.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                renderer,
            ],
        )
    )
    root = logging.getLogger()
    # Ours replaces the one a previous configure (or basicConfig) made; others (a test's
    # capture) stay.
    for old in root.handlers[:]:
        if getattr(old, "sbx_logs", False) or type(old) is logging.StreamHandler:
            root.removeHandler(old)
    handler.sbx_logs = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(max(_LEVELS[level], logging.INFO))
    # fastmcp gives its logger a handler of its own (rich text) and stops it propagating,
    # at import: told not to (if not imported yet), and undone (if it was).
    os.environ.setdefault("FASTMCP_LOG_ENABLED", "false")
    for name in ("fastmcp", "uvicorn", "uvicorn.error", "uvicorn.access"):
        library = logging.getLogger(name)
        library.handlers = []
        library.propagate = True
