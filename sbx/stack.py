"""Finding a stack: its state directory, its API key, its NATS URL.

Every subcommand resolves the stack the same way: ``NATS_URL`` if set, else the
``stack.json`` that a running ``sbx up`` wrote into ``--state-dir`` (default
``SBX_STATE_DIR`` or ``.sbx/``).
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import socket
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

from sbx_api import errors
from sbx_client.local import API_KEY_FILE, STACK_FILE
from sbx_client.local import DEFAULT_STATE_DIR as DEFAULT_STATE_DIR  # where the client looks too
from sbx_client.local import state_dir as state_dir
from shared.infrastructure.settings import bus

SERVICES = ("gateway", "scheduler", "pool_manager", "executor", "reaper", "proxy_scaler")


def service_name(module: str) -> str:
    """``pool_manager`` (module) -> ``pool-manager`` (service name)."""
    return module.replace("_", "-")


@dataclass(frozen=True)
class StackInfo:
    """What a running ``sbx up`` publishes about itself in ``<state-dir>/stack.json``."""

    pid: int
    nats_url: str
    namespace: str
    gateway_url: str | None
    embedded_nats: bool
    phase: str = "up"
    """``starting`` (NATS answers, the services are coming up), ``up`` or ``stopping``."""

    @staticmethod
    def path(directory: Path) -> Path:
        return directory / STACK_FILE

    def write(self, directory: Path) -> None:
        tmp = directory / f"{STACK_FILE}.tmp"
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        tmp.replace(self.path(directory))

    @classmethod
    def read(cls, directory: Path) -> StackInfo | None:
        try:
            return cls(**json.loads(cls.path(directory).read_text()))
        except (OSError, ValueError, TypeError):
            return None


LOCK = "up.lock"
"""Held (flock) by the running ``sbx up`` (or ``sbx down``) of a state dir, which writes
``<role> <pid>`` in it."""


def _open_lock(directory: Path, flags: int) -> IO[str] | None:
    try:  # never through a symlink planted in place of the lock
        fd = os.open(directory / LOCK, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError:
        return None
    return os.fdopen(fd, "r+" if flags & os.O_RDWR else "r")


def lock_holder(directory: Path, role: str = "up") -> int | None:
    """The pid of the ``sbx <role>`` holding the state dir's lock (0 if it holds it but is
    another command, or has not written its pid yet), or None if nothing holds it."""
    handle = _open_lock(directory, os.O_RDONLY)
    if handle is None:
        return None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            said = handle.read().split()
            return int(said[1]) if len(said) == 2 and said[0] == role and said[1].isdigit() else 0
        fcntl.flock(handle, fcntl.LOCK_UN)
        return None


def lock(state: Path, role: str = "up") -> IO[str]:
    """One ``sbx up`` (or ``sbx down``) per state dir: the lock is held for as long as the
    file stays open."""
    state.mkdir(parents=True, exist_ok=True, mode=0o700)
    lock = _open_lock(state, os.O_RDWR | os.O_CREAT)
    if lock is None:
        raise errors.ConfigError(f"cannot open {state / LOCK} (a symlink there is refused)")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        holder = lock_holder(state)
        raise errors.Conflict(
            f"another `sbx up` or `sbx down` is already running with state dir {state}/"
            + (f" (pid {holder})" if holder else "")
        ) from None
    lock.truncate(0)
    lock.write(f"{role} {os.getpid()}\n")  # `sbx down` signals an `up` only
    lock.flush()
    return lock


def bus_settings(directory: Path, env: Mapping[str, str]) -> bus.BusSettings:
    """How to reach the stack's NATS, or ConfigError saying how to get one running."""
    if env.get("NATS_URL"):
        return bus.BusSettings.from_env(env)
    info = StackInfo.read(directory)
    if info is None:
        raise errors.ConfigError(
            f"no stack found: nothing running under {directory}/ (start one with `sbx up`, "
            "pass --state-dir, or set NATS_URL)"
        )
    token = nats_token(directory) if info.embedded_nats else env.get("NATS_TOKEN")
    return bus.BusSettings(
        nats_url=info.nats_url,
        namespace=info.namespace,
        nats_token=token,
        retention=bus.RetentionSettings.from_env(env),
    )


def nats_token(directory: Path) -> str:
    """The embedded server's token (``<state-dir>/nats-token``, created 0600 if missing)."""
    return _secret(directory / "nats-token", lambda: secrets.token_hex(32))[0]


def api_key(directory: Path, env: Mapping[str, str]) -> tuple[str, bool]:
    """The key to use: ``SANDBOX_API_KEY``, else ``<state-dir>/api-key`` (created 0600
    if missing). Returns ``(key, generated_now)``."""
    if env.get("SANDBOX_API_KEY"):
        return env["SANDBOX_API_KEY"], False
    return _secret(directory / API_KEY_FILE, lambda: secrets.token_urlsafe(32))


def _secret(path: Path, make: Callable[[], str]) -> tuple[str, bool]:
    """Read a secret file, or create it (mode 0600) with ``make()``. ``(value, created)``."""
    try:
        return path.read_text().strip(), False
    except FileNotFoundError:
        pass
    value = make()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(value + "\n")
    return value, True


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the kernel's pick)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])
