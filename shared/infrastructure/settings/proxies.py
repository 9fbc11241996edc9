"""The credential-proxy fleet (proxy-scaler) and where its program lives."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from sbx_api import errors
from shared.infrastructure.settings import values

#: Where scripts/setup installs the proxy's own environment.
DEFAULT_PROXY_BIN = Path(__file__).resolve().parents[3] / "proxy" / ".venv" / "bin" / "sbx-proxy"


@dataclass(frozen=True)
class ProxySettings:
    """The credential-proxy fleet (proxy-scaler)."""

    config: str = ""
    """The proxies' TOML config (``SBX_PROXY_CONFIG``); empty: inject nothing, tunnel everything."""
    sandboxes_per_proxy: int = 100
    """About one proxy per this many running sandboxes (``SBX_SANDBOXES_PER_PROXY``)."""
    drain: float = 30.0
    """How long a proxy being removed keeps serving connections already open (``SBX_PROXY_DRAIN``)."""
    keep_warm: float = 600.0
    """One proxy stays up this long after the last sandbox (and after start-up), so the
    next sandbox does not wait for one to start; then the fleet scales to zero
    (``SBX_PROXY_KEEP_WARM``; 0 = scale to zero at once)."""
    binary: str = str(DEFAULT_PROXY_BIN)
    """The ``sbx-proxy`` program (``SBX_PROXY_BIN``)."""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> ProxySettings:
        raw = env.get("SBX_SANDBOXES_PER_PROXY", str(cls.sandboxes_per_proxy)).strip()
        if not raw.isdigit() or not 1 <= int(raw) <= 100_000:
            raise errors.ConfigError(
                f"SBX_SANDBOXES_PER_PROXY={raw!r} must be a whole number from 1 to 100000"
            )
        return cls(
            config=env.get("SBX_PROXY_CONFIG", "").strip(),
            sandboxes_per_proxy=int(raw),
            drain=values.duration(env, "SBX_PROXY_DRAIN", cls.drain),
            keep_warm=values.duration(env, "SBX_PROXY_KEEP_WARM", cls.keep_warm),
            binary=env.get("SBX_PROXY_BIN", cls.binary),
        )
