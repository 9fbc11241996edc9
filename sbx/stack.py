"""Finding a stack: its state directory, its API key, its NATS URL.

Every subcommand resolves the stack the same way: ``NATS_URL`` if set, else the
``stack.json`` that a running ``sbx up`` wrote into ``--state-dir`` (default
``SBX_STATE_DIR`` or ``.sbx/``).
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from shared.contract import errors
from shared.infrastructure import settings

DEFAULT_STATE_DIR = ".sbx"
SERVICES = ("gateway", "scheduler", "pool_manager", "executor", "reaper", "proxy_scaler")


def service_name(module: str) -> str:
    """``pool_manager`` (module) -> ``pool-manager`` (service name)."""
    return module.replace("_", "-")


def state_dir(option: Path | None, env: Mapping[str, str]) -> Path:
    return option or Path(env.get("SBX_STATE_DIR", DEFAULT_STATE_DIR))


@dataclass(frozen=True)
class StackInfo:
    """What a running ``sbx up`` publishes about itself in ``<state-dir>/stack.json``."""

    pid: int
    nats_url: str
    namespace: str
    gateway_url: str | None
    embedded_nats: bool

    @staticmethod
    def path(directory: Path) -> Path:
        return directory / "stack.json"

    def write(self, directory: Path) -> None:
        tmp = directory / "stack.json.tmp"
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        tmp.replace(self.path(directory))

    @classmethod
    def read(cls, directory: Path) -> StackInfo | None:
        try:
            return cls(**json.loads(cls.path(directory).read_text()))
        except (OSError, ValueError, TypeError):
            return None


def bus_settings(directory: Path, env: Mapping[str, str]) -> settings.BusSettings:
    """How to reach the stack's NATS, or ConfigError saying how to get one running."""
    if env.get("NATS_URL"):
        return settings.BusSettings.from_env(env)
    info = StackInfo.read(directory)
    if info is None:
        raise errors.ConfigError(
            f"no stack found: nothing running under {directory}/ (start one with `sbx up`, "
            "pass --state-dir, or set NATS_URL)"
        )
    token = nats_token(directory) if info.embedded_nats else env.get("NATS_TOKEN")
    return settings.BusSettings(nats_url=info.nats_url, namespace=info.namespace, nats_token=token)


def nats_token(directory: Path) -> str:
    """The embedded server's token (``<state-dir>/nats-token``, created 0600 if missing)."""
    return _secret(directory / "nats-token", lambda: secrets.token_hex(32))[0]


def api_key(directory: Path, env: Mapping[str, str]) -> tuple[str, bool]:
    """The key to use: ``SANDBOX_API_KEY``, else ``<state-dir>/api-key`` (created 0600
    if missing). Returns ``(key, generated_now)``."""
    if env.get("SANDBOX_API_KEY"):
        return env["SANDBOX_API_KEY"], False
    return _secret(directory / "api-key", lambda: secrets.token_urlsafe(32))


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
