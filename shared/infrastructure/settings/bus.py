"""How a process reaches NATS, which slice of it a stack uses, and how much of the event
stream is kept."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from sbx_api import errors
from shared.infrastructure.settings import values

_NAMESPACE = re.compile(r"[a-z][a-z0-9_]{0,31}")


@dataclass(frozen=True)
class BusSettings:
    """How to reach NATS and which slice of it this stack uses."""

    nats_url: str = "nats://127.0.0.1:4222"
    """NATS server URL(s), comma separated (``NATS_URL``)."""
    namespace: str = "sbx"
    """Prefix of every subject, stream and bucket (``SBX_NAMESPACE``); lets several
    stacks, or several tests, share one NATS server without seeing each other."""
    request_timeout: float = 5.0
    """How long a command waits for its reply (``SBX_REQUEST_TIMEOUT``)."""
    nats_token: str | None = field(default=None, repr=False)
    """Token for NATS authorization (``NATS_TOKEN``); ``sbx up`` generates one for the
    server it starts and hands it to its children."""
    replicas: int = 1
    """Copies of the event stream, the pool stream and every bucket in a NATS cluster
    (``SBX_NATS_REPLICAS``, 1-5), applied when they are created; a service that finds them
    never changes their count (``sbx replicas`` does, on purpose)."""
    retention: RetentionSettings = field(default_factory=lambda: RetentionSettings())
    """How much of the event stream is kept: audit records' TTL (every writer of one) and
    the byte budget (the reaper)."""

    @property
    def servers(self) -> list[str]:
        return [s.strip() for s in self.nats_url.split(",") if s.strip()]

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> BusSettings:
        namespace = env.get("SBX_NAMESPACE", cls.namespace)
        if not _NAMESPACE.fullmatch(namespace):
            raise errors.ConfigError(
                f"SBX_NAMESPACE={namespace!r} must be 1-32 characters: a-z, 0-9, '_', starting with a letter"
            )
        return cls(
            nats_url=env.get("NATS_URL", cls.nats_url),
            namespace=namespace,
            request_timeout=values.duration(env, "SBX_REQUEST_TIMEOUT", cls.request_timeout, minimum=0.05),
            nats_token=env.get("NATS_TOKEN") or None,
            replicas=_replicas(env),
            retention=RetentionSettings.from_env(env),
        )


@dataclass(frozen=True)
class RetentionSettings:
    """What the event stream keeps. Audit records (``exec``, ``image``, ``egress``) expire;
    the aggregates' events (sessions, sandboxes, snapshots, instances, proxies) never do:
    the projections are their fold (docs/architecture.md, "Retention")."""

    audit_max_age: float = 30 * 86400.0
    """An audit record is removed this long after it was written (``SBX_AUDIT_MAX_AGE``;
    0: never, only the byte limit removes them). Each record carries it (``Nats-TTL``), so
    a change applies to records written from then on."""
    events_max_bytes: int = 8 * 1024**3
    """The event stream's byte budget (``SBX_EVENTS_MAX_BYTES``): past 90 % of it the
    reaper removes the oldest audit records, down to 80 %. The aggregates' events are never
    removed; should they alone fill the disk, the stream refuses new events."""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> RetentionSettings:
        return cls(
            audit_max_age=values.duration(env, "SBX_AUDIT_MAX_AGE", cls.audit_max_age, minimum=0),
            events_max_bytes=values.size(
                env, "SBX_EVENTS_MAX_BYTES", cls.events_max_bytes, minimum=64 * 1024**2
            ),
        )


def _replicas(env: Mapping[str, str]) -> int:
    raw = env.get("SBX_NATS_REPLICAS", "1").strip()
    if raw not in ("1", "2", "3", "4", "5"):
        raise errors.ConfigError(f"SBX_NATS_REPLICAS={raw!r} must be 1 to 5 (3 on a 3-node cluster)")
    return int(raw)
