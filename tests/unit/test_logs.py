"""Every library's log lines are JSON with the service's identity (issue 20, item 5)."""

from __future__ import annotations

import json
import logging
import threading

import fastmcp  # noqa: F401  (imported first: it gives its logger a text handler of its own)
import pytest
import structlog

from shared.infrastructure import logs


@pytest.fixture
def restored_logging():
    """configure() is process-wide: put back what the other tests run with."""
    saved = structlog.get_config()
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    structlog.configure(**saved)
    structlog.contextvars.clear_contextvars()
    root.handlers[:] = handlers
    root.setLevel(level)


def test_library_logs_are_json_lines_with_service_and_logger(capfd, restored_logging):
    logs.configure(service="gateway", instance="g-1")
    logs.configure(service="gateway", instance="g-1")  # (twice: still one line per record)
    logging.getLogger("uvicorn.error").warning("listening on %s", "port 1")
    logging.getLogger("fastmcp.server").warning("from fastmcp")
    worker = threading.Thread(target=lambda: logging.getLogger("mcp.server").error("from a thread"))
    worker.start()
    worker.join()
    try:
        raise ZeroDivisionError("boom")
    except ZeroDivisionError:
        logging.getLogger("nats").exception("failed")
    structlog.get_logger("ours").warning("native", api_key="not-shown")
    lines = [json.loads(line) for line in capfd.readouterr().err.splitlines() if line.startswith("{")]
    by_event = {line["event"]: line for line in lines}
    assert len(lines) == len(by_event) == 5, lines
    for line in lines:
        assert line["service"] == "gateway" and line["instance"] == "g-1" and "timestamp" in line
    assert by_event["listening on port 1"]["logger"] == "uvicorn.error"
    assert by_event["from fastmcp"]["logger"] == "fastmcp.server"
    assert by_event["from a thread"]["level"] == "error"
    assert "ZeroDivisionError: boom" in by_event["failed"]["exception"]
    assert by_event["native"]["api_key"] == "[redacted]"
