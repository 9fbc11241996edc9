"""How much audit text one session may cause (the executor's limit)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from sbx_api import errors
from shared.infrastructure.settings import values


@dataclass(frozen=True)
class AuditRateSettings:
    """How much audit text one session may cause (the executor refuses calls past it)."""

    bytes_per_window: int = 4 * 1024**2
    """Audit bytes one session may cause per window (``SBX_AUDIT_RATE``; 0: no limit):
    each audited call counts its recorded command text plus a fixed overhead per record."""
    window: float = 600.0
    """The window (``SBX_AUDIT_RATE_WINDOW``, at most a day): the allowance refills
    evenly over it."""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> AuditRateSettings:
        made = cls(
            bytes_per_window=values.size(env, "SBX_AUDIT_RATE", cls.bytes_per_window, minimum=0),
            window=values.duration(env, "SBX_AUDIT_RATE_WINDOW", cls.window, minimum=1),
        )
        if 0 < made.bytes_per_window < AUDIT_RATE_MINIMUM:
            raise errors.ConfigError(
                f"SBX_AUDIT_RATE={env['SBX_AUDIT_RATE']!r} must be 0 (no limit) or at least 64k"
            )
        if made.window > AUDIT_RATE_WINDOW_MAX:
            raise errors.ConfigError(
                f"SBX_AUDIT_RATE_WINDOW={env['SBX_AUDIT_RATE_WINDOW']!r} must be at most a day (1d)"
            )
        return made


AUDIT_RATE_MINIMUM = 64 * 1024
"""Below this, a few ordinary calls would use a session's whole allowance."""
AUDIT_RATE_WINDOW_MAX = 86400.0
"""The audit-rate bucket forgets a session after a day (its TTL), so no window is longer."""
