"""The JetStream definitions of a topology: the event and pool streams and the buckets,
with their retention, storage and limits (the names are the contract's, in
``shared.contract.subjects``)."""

from __future__ import annotations

from nats.js import api

from shared.contract import subjects


def events_stream(topology: subjects.Topology, replicas: int = 1) -> api.StreamConfig:
    """No limit of its own: the server never removes an event on its own, because a
    projection is the fold of *all* its aggregate's events. Audit records expire by their
    own TTL (``allow_msg_ttl``); the byte limit is the reaper's, which removes the oldest
    audit records (:mod:`shared.infrastructure.retention`). JetStream's ``max_bytes`` is
    not used: it cannot tell audit records from state, and it reserves its whole size on
    every server at creation (a stack would not start on a smaller disk). ``discard=new``:
    should an operator add a limit, new events are refused rather than old state dropped."""
    return api.StreamConfig(
        name=topology.events_stream,
        description="Every lifecycle event of the product: the source of truth and the audit log.",
        subjects=[topology.events_all],
        retention=api.RetentionPolicy.LIMITS,
        storage=api.StorageType.FILE,
        discard=api.DiscardPolicy.NEW,
        allow_msg_ttl=True,
        duplicate_window=subjects.DUPLICATE_WINDOW_SECONDS,
        allow_direct=True,
        num_replicas=replicas,
    )


def pool_stream(topology: subjects.Topology, replicas: int = 1) -> api.StreamConfig:
    return api.StreamConfig(
        name=topology.pool_stream,
        description="Idle pool sandboxes offered to claimers (work queue: each offer taken once).",
        subjects=[f"{topology.namespace}.pool.idle.*"],
        retention=api.RetentionPolicy.WORK_QUEUE,
        storage=api.StorageType.FILE,
        duplicate_window=subjects.DUPLICATE_WINDOW_SECONDS,
        num_replicas=replicas,
    )


def activity_bucket(topology: subjects.Topology, replicas: int = 1) -> api.KeyValueConfig:
    return api.KeyValueConfig(
        bucket=topology.activity_bucket,
        description="Last tool call per session, for the idle rule.",
        history=1,
        ttl=subjects.ACTIVITY_TTL_SECONDS,
        storage=api.StorageType.FILE,
        replicas=replicas,
    )


def leases_bucket(topology: subjects.Topology, replicas: int = 1) -> api.KeyValueConfig:
    return api.KeyValueConfig(
        bucket=topology.leases_bucket,
        description="Leases: a key held by one instance, expiring unless renewed.",
        history=1,
        ttl=subjects.LEASE_TTL_SECONDS,
        storage=api.StorageType.FILE,
        replicas=replicas,
    )


def projection_bucket(topology: subjects.Topology, kind: str, replicas: int = 1) -> api.KeyValueConfig:
    return api.KeyValueConfig(
        bucket=topology.bucket(kind),
        description=f"Projection of {kind} events (rebuildable with `sbx replay`).",
        history=1,
        storage=api.StorageType.FILE,
        replicas=replicas,
    )


def audit_rate_bucket(topology: subjects.Topology, replicas: int = 1) -> api.KeyValueConfig:
    return api.KeyValueConfig(
        bucket=topology.audit_rate_bucket,
        description="Audit bytes each session caused lately, for the executor's rate limit.",
        history=1,
        ttl=subjects.AUDIT_RATE_TTL_SECONDS,
        storage=api.StorageType.FILE,
        replicas=replicas,
    )


def health_bucket(topology: subjects.Topology, replicas: int = 1) -> api.KeyValueConfig:
    return api.KeyValueConfig(
        bucket=topology.health_bucket,
        description="Service heartbeats; an entry expires when its instance stops reporting.",
        history=1,
        ttl=subjects.HEALTH_TTL_SECONDS,
        storage=api.StorageType.FILE,  # survives a NATS restart like the rest
        replicas=replicas,
    )


def buckets(topology: subjects.Topology, replicas: int = 1) -> list[api.KeyValueConfig]:
    """Every bucket of a topology: the projections, health, leases, activity and audit rate."""
    return [
        *(projection_bucket(topology, kind, replicas) for kind in subjects.PROJECTED_KINDS),
        health_bucket(topology, replicas),
        leases_bucket(topology, replicas),
        activity_bucket(topology, replicas),
        audit_rate_bucket(topology, replicas),
    ]
