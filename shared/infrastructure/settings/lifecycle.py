"""The warm pools, the limits on running and stopped sandboxes, and the lifetimes
(pool-manager, scheduler, reaper)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass

from sbx_api import errors
from shared.contract import ids
from shared.infrastructure.settings import values


@dataclass(frozen=True)
class LifecycleSettings:
    """The warm pool, the limits and the lifetimes (pool-manager, scheduler, reaper)."""

    pool_min_idle: int = 2
    """Ready, unclaimed sandboxes kept for the default pool (``SBX_POOL_MIN_IDLE``; 0 = no pool)."""
    pool_image: str = "default"
    """Image of the default pool's sandboxes (``SBX_POOL_IMAGE``); changing it rolls the pool over."""
    pool_max_age: float = 3600.0
    """An idle pool sandbox older than this is recycled: removed, and the refill makes a
    fresh one (``SBX_POOL_MAX_AGE``)."""
    pool_autosize: bool = True
    """Whether each configured pool keeps, beyond its ``min_idle``, its busiest recent
    demand (``SBX_POOL_AUTOSIZE``; see ``shared/domain/poolsizing.py``)."""
    pool_max_idle: int = 100
    """Most idle sandboxes an autosized pool keeps (``SBX_POOL_MAX_IDLE``; its
    ``min_idle`` may be higher, and ``max_running`` bounds all)."""
    pool_horizon: float = 10.0
    """An autosized pool keeps ready its most new sessions within this many seconds
    (``SBX_POOL_HORIZON``)..."""
    pool_demand_window: float = 600.0
    """...of the last this many seconds (``SBX_POOL_DEMAND_WINDOW``)."""
    extra_pools: tuple[tuple[str, str, bool, bool, int, str | None], ...] = ()
    """More pools (``SBX_POOLS``, JSON: ``[{"name": "py", "image": "py312", "min_idle": 2,
    "run_as_root": true, "writable_root": true, "org": "acme"}]``) as (name, image,
    run_as_root, writable_root, min_idle, org). A pool with ``org`` serves only that
    organisation's sessions, and its sandboxes show its package cache from the start."""
    caches_at_create: bool = False
    """Whether a sandbox's package cache must be chosen when it is created (Kubernetes with
    ``SBX_K8S_CACHE_STORAGE_CLASS``: a pod's volumes are fixed). Then a session of an
    organisation never takes a shared pool's sandbox: its organisation's pool, else a
    cold start with its cache. Read from ``SBX_RUNTIME`` and that setting."""
    max_running: int = 100
    """Most sandboxes running at once, idle pool included (``SBX_MAX_RUNNING``)."""
    max_stopped: int = 100
    """Most stopped sandboxes kept (``SBX_MAX_STOPPED``); the oldest are purged beyond it."""
    max_lifetime: float = 3600.0
    """A running session's sandbox is stopped this long after it started (``SBX_MAX_LIFETIME``)."""
    idle_timeout: float = 600.0
    """...or after this long without a tool call (``SBX_IDLE_TIMEOUT``), paused or not."""
    pause_timeout: float = 300.0
    """A running session's sandbox is paused (every process frozen, memory kept) after this
    long without a tool call, where the runtime can pause (``SBX_PAUSE_TIMEOUT``; 0: never;
    at or above ``idle_timeout``: it is stopped first). Its next call resumes it."""
    hibernate_timeout: float = 0.0
    """A session's sandbox, running or paused, is hibernated after this long without a tool
    call (``SBX_HIBERNATE_TIMEOUT``; 0, the default: never): stopped with its files kept
    (``sandbox.stopped``, reason ``hibernated``) while the session stays active, so its
    next call starts it again. Only below ``idle_timeout``, which then stops the session."""
    pause_running_jobs: bool = False
    """Whether an idle pause may freeze a sandbox while one of its async jobs runs
    (``SBX_PAUSE_RUNNING_JOBS=true``); by default a running job counts as activity."""
    stopped_retention: float = 86400.0
    """A stopped session (and its workspace) is purged after this long (``SBX_STOPPED_RETENTION``)."""
    reaper_interval: float = 30.0
    """How often the reaper applies the rules and runs the self-healing sweep (``SBX_REAPER_INTERVAL``)."""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> LifecycleSettings:
        def count(name: str, default: int, minimum: int) -> int:
            raw = env.get(name)
            if raw is None:
                return default
            if not re.fullmatch(r"[0-9]{1,9}", raw.strip()) or int(raw) < minimum:
                raise errors.ConfigError(f"{name}={raw!r} must be a whole number of at least {minimum}")
            return int(raw)

        made = cls(
            pool_min_idle=count("SBX_POOL_MIN_IDLE", cls.pool_min_idle, 0),
            pool_image=_image(env.get("SBX_POOL_IMAGE", cls.pool_image)),
            extra_pools=_pools(env.get("SBX_POOLS", "")),
            pool_max_age=values.duration(env, "SBX_POOL_MAX_AGE", cls.pool_max_age, minimum=1),
            pool_autosize=values.flag({"SBX_POOL_AUTOSIZE": "true", **env}, "SBX_POOL_AUTOSIZE"),
            pool_max_idle=count("SBX_POOL_MAX_IDLE", cls.pool_max_idle, 0),
            pool_horizon=values.duration(env, "SBX_POOL_HORIZON", cls.pool_horizon, minimum=0.1),
            pool_demand_window=values.duration(
                env, "SBX_POOL_DEMAND_WINDOW", cls.pool_demand_window, minimum=1
            ),
            max_running=count("SBX_MAX_RUNNING", cls.max_running, 1),
            max_stopped=count("SBX_MAX_STOPPED", cls.max_stopped, 0),
            max_lifetime=values.duration(env, "SBX_MAX_LIFETIME", cls.max_lifetime, minimum=1),
            idle_timeout=values.duration(env, "SBX_IDLE_TIMEOUT", cls.idle_timeout, minimum=1),
            pause_timeout=values.duration(env, "SBX_PAUSE_TIMEOUT", cls.pause_timeout, minimum=0),
            pause_running_jobs=values.flag(env, "SBX_PAUSE_RUNNING_JOBS"),
            hibernate_timeout=values.duration(env, "SBX_HIBERNATE_TIMEOUT", cls.hibernate_timeout, minimum=0),
            stopped_retention=values.duration(env, "SBX_STOPPED_RETENTION", cls.stopped_retention, minimum=1),
            reaper_interval=values.duration(env, "SBX_REAPER_INTERVAL", cls.reaper_interval, minimum=0.1),
            caches_at_create=env.get("SBX_RUNTIME", "local").strip().lower() == "kubernetes"
            and bool(env.get("SBX_K8S_CACHE_STORAGE_CLASS", "").strip()),
        )
        if made.pool_min_idle + sum(p[4] for p in made.extra_pools) > made.max_running:
            raise errors.ConfigError(
                f"SBX_POOL_MIN_IDLE={made.pool_min_idle} cannot exceed SBX_MAX_RUNNING={made.max_running}"
            )
        return made


def _pools(raw: str) -> tuple[tuple[str, str, bool, bool, int, str | None], ...]:
    if not raw.strip():
        return ()
    try:
        items = json.loads(raw)
        if not isinstance(items, list):
            raise TypeError("a JSON list is expected")
        out = []
        for item in items:
            name = str(item["name"])
            if not re.fullmatch(r"[a-z0-9][a-z0-9_-]{0,31}", name) or name == "default":
                raise ValueError(f"pool name {name!r} must be 1-32 of a-z 0-9 _ - and not 'default'")
            min_idle = int(item.get("min_idle", 1))
            if min_idle < 0:
                raise ValueError("min_idle must be at least 0")
            org = item.get("org")
            if org is not None and (not isinstance(org, str) or not org.strip()):
                raise ValueError(f"pool {name!r}: org must be an organisation id")
            if org is not None:
                org = ids.validate_attribution(org, what=f"pool {name!r} org")
            out.append(
                (name, _image(str(item.get("image", "default"))), bool(item.get("run_as_root", True)),
                 bool(item.get("writable_root", True)), min_idle, org)
            )  # fmt: skip
    except (ValueError, TypeError, KeyError, errors.InvalidInput) as exc:
        raise errors.ConfigError(f"SBX_POOLS is not a valid pool list: {exc}") from None
    if len({p[0] for p in out}) != len(out):
        raise errors.ConfigError("SBX_POOLS has two pools with the same name")
    return tuple(out)


def _image(value: str) -> str:
    try:
        return ids.validate_image(value) or LifecycleSettings.pool_image
    except errors.InvalidInput as exc:
        raise errors.ConfigError(f"SBX_POOL_IMAGE: {exc.message}") from None
