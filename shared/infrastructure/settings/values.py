"""How settings read one value from the environment: durations, sizes, counts, ports,
switches and choices. Every error names the variable and says what it accepts."""

from __future__ import annotations

import re
from collections.abc import Mapping

from sbx_api import errors

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_SIZE = re.compile(r"(\d+)([kmg]?)i?b?")


def parse_duration(text: str, *, name: str = "duration") -> float:
    """Seconds in ``text``: ``90`` (seconds), ``90s``, ``500ms``, ``10m``, ``1h``, ``1h30m``, ``1d``."""
    raw = text.strip().lower()
    if not raw:
        raise errors.ConfigError(f"{name} is empty; use e.g. 90, 90s, 10m or 1h")
    try:
        seconds = float(raw)
    except ValueError:
        pos, seconds = 0, 0.0
        for match in _DURATION_PART.finditer(raw):
            if match.start() != pos:
                break
            seconds += float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
            pos = match.end()
        if pos != len(raw) or pos == 0:
            raise errors.ConfigError(
                f"{name}={text!r} is not a duration; use e.g. 90, 90s, 500ms, 10m, 1h or 1h30m"
            ) from None
    if seconds < 0 or seconds != seconds or seconds == float("inf"):
        raise errors.ConfigError(f"{name}={text!r} must be a finite, non-negative duration")
    return seconds


def duration(env: Mapping[str, str], name: str, default: float, *, minimum: float = 0.0) -> float:
    if name not in env:
        return default
    value = parse_duration(env[name], name=name)
    if value < minimum:
        raise errors.ConfigError(f"{name}={env[name]!r} is below the minimum of {minimum}s")
    return value


def flag(env: Mapping[str, str], name: str) -> bool:
    raw = env.get(name, "false").strip().lower()
    if raw not in ("true", "false", "1", "0", "yes", "no"):
        raise errors.ConfigError(f"{name}={env[name]!r} must be true or false")
    return raw in ("true", "1", "yes")


def port(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None:
        return default
    if not raw.isdigit() or not 0 <= int(raw) <= 65535:
        raise errors.ConfigError(f"{name}={raw!r} is not a TCP port (0-65535)")
    return int(raw)


def choice(env: Mapping[str, str], name: str, default: str, allowed: tuple[str, ...]) -> str:
    value = env.get(name, default).strip().lower()
    if value not in allowed:
        raise errors.ConfigError(f"{name}={value!r} must be one of: {', '.join(allowed)}")
    return value


def count(env: Mapping[str, str], name: str, default: int, low: int, high: int) -> int:
    raw = env.get(name, str(default)).strip()
    if not raw.isdigit() or not low <= int(raw) <= high:
        raise errors.ConfigError(f"{name}={raw!r} must be a whole number from {low} to {high}")
    return int(raw)


def parse_size(raw: str, *, name: str = "size") -> int:
    """Bytes in ``raw``: ``65536``, ``512k``, ``512m``, ``2g`` (also ``2GiB``, ``2gb``)."""
    match = _SIZE.fullmatch(raw.strip().lower())
    if not match:
        raise errors.ConfigError(f"{name}={raw!r} is not a size; use e.g. 512m, 2g or 65536")
    return int(match.group(1)) * {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}[match.group(2)]


def size(env: Mapping[str, str], name: str, default: int, *, minimum: int) -> int:
    raw = env.get(name)
    if raw is None:
        return default
    value = parse_size(raw, name=name)
    if value < minimum:
        raise errors.ConfigError(f"{name}={raw!r} is below the minimum of {minimum} bytes")
    return value
