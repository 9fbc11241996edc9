"""Structured logs: one JSON object a line on stderr (or readable console lines).

Every line carries ``service`` and ``instance``. Secrets are never passed to a
logger; as a second line of defence any key named like a secret is redacted.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog

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
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _redact,
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service, instance=instance)
    # Libraries that log through the standard library (uvicorn, nats) go to stderr too.
    logging.basicConfig(
        level=max(_LEVELS[level], logging.INFO),
        stream=sys.stderr,
        format="%(levelname)s %(name)s %(message)s",
    )
