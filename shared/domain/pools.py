"""Warm pool specs: the contract between the pool-manager (which fills pools) and the
scheduler (which claims from them). A pool's id carries a hash of its spec, so changing
the spec makes a new pool."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from sbx_api import errors
from shared.contract import references, states

SNAPSHOT_POOL_PREFIX = "snapshot:"
"""A snapshot's pool's name: the snapshot id after it (no configured pool is named so:
``SBX_POOLS`` names are plain words)."""


@dataclass(frozen=True)
class PoolSpec:
    name: str = "default"
    image: str = "default"
    run_as_root: bool = True
    writable_root: bool = True
    min_idle: int = 2
    org: str | None = None
    """The organisation this pool is for: it serves only that organisation's sessions, and
    its sandboxes show that organisation's package cache from the start."""
    snapshot: str | None = None
    """The snapshot its sandboxes start from (a snapshot kept warm): it serves only forks
    and restores of that snapshot."""

    @property
    def pool_id(self) -> str:
        """``name@hash``: what sandboxes of this pool carry in ``pool``."""
        fields: list[object] = [self.image, self.run_as_root, self.writable_root]
        if self.org is not None or self.snapshot is not None:  # (neither: ids as before)
            fields.append(self.org)
        if self.snapshot is not None:
            fields.append(self.snapshot)
        shape = json.dumps(fields).encode()
        return f"{self.name}@{hashlib.blake2b(shape, digest_size=4).hexdigest()}"

    def serves(self, options: Mapping[str, object]) -> bool:
        """Whether a sandbox of this pool fits a session asking for these options."""
        return (
            same_image(str(options.get("image", "default")), self.image)
            and options.get("run_as_root", True) == self.run_as_root
            and options.get("writable_root", True) == self.writable_root
            and not options.get("use_kata", False)
            # A snapshot's files are below its sandbox's from the start: only its own pool fits.
            and options.get("snapshot") == self.snapshot
        )

    @classmethod
    def of_snapshot(cls, snapshot: states.SnapshotState) -> PoolSpec:
        """The pool of idle sandboxes started from a snapshot kept warm (``warm`` of them)."""
        return cls(
            name=SNAPSHOT_POOL_PREFIX + snapshot.snapshot_id,
            image=snapshot.image,
            run_as_root=snapshot.run_as_root,
            writable_root=snapshot.writable_root,
            min_idle=snapshot.warm,
            org=snapshot.org_id,
            snapshot=snapshot.snapshot_id,
        )


def same_image(a: str, b: str) -> bool:
    """Whether two image names stand for the same image: equal, or the same reference
    once normalised (``python:3.12`` is ``docker.io/library/python:3.12``)."""
    if a == b:
        return True
    try:
        return str(references.parse(a)) == str(references.parse(b))
    except errors.InvalidInput:
        return False


class PoolSettings(Protocol):
    """What pools are configured from (``LifecycleSettings`` in the infrastructure)."""

    @property
    def pool_image(self) -> str: ...
    @property
    def pool_min_idle(self) -> int: ...
    @property
    def extra_pools(self) -> Sequence[tuple[str, str, bool, bool, int, str | None]]: ...


def configured(lifecycle: PoolSettings) -> list[PoolSpec]:
    """The pools to keep warm: the default one (``SBX_POOL_*``) and any in ``SBX_POOLS``."""
    specs = (
        [PoolSpec(image=lifecycle.pool_image, min_idle=lifecycle.pool_min_idle)]
        if lifecycle.pool_min_idle
        else []
    )
    for name, image, run_as_root, writable_root, min_idle, org in lifecycle.extra_pools:
        if min_idle:
            specs.append(PoolSpec(name, image, run_as_root, writable_root, min_idle, org))
    return specs


def warm_snapshots(snapshots: Iterable[states.SnapshotState]) -> list[PoolSpec]:
    """The pools of the snapshots kept warm (ready ones with ``warm`` above 0), by id."""
    kept = (s for s in snapshots if s.status == "ready" and s.warm > 0)
    return [PoolSpec.of_snapshot(s) for s in sorted(kept, key=lambda s: s.snapshot_id)]


def serving(
    specs: list[PoolSpec],
    options: Mapping[str, object],
    org: str | None = None,
    *,
    caches_at_create: bool = False,
) -> PoolSpec | None:
    """The pool a session of ``org`` (None: no organisation) claims from: its
    organisation's pool that fits the options, else the first shared pool that fits;
    none for an organisation's session where caches are chosen at creation
    (``LifecycleSettings.caches_at_create``), which then starts cold with its cache. A
    pool of an organisation never serves anyone else."""
    if org is not None:
        own = next((s for s in specs if s.org == org and s.serves(options)), None)
        if own is not None or caches_at_create:
            return own
    return next((s for s in specs if s.org is None and s.serves(options)), None)


def ready(sandbox: states.SandboxState) -> bool:
    """An unclaimed pool sandbox that is running: a claim can take it now."""
    return sandbox.pool is not None and sandbox.session_id is None and sandbox.status == "running"


def preparing(sandboxes: Iterable[states.SandboxState], pool_id: str) -> int:
    """How many of the pool's unclaimed sandboxes are requested or running (being started,
    being warmed up before their offer, or offered): a session refused a cold start at
    ``max_running`` waits for one of them instead."""
    return sum(
        1
        for s in sandboxes
        if s.pool == pool_id and s.session_id is None and s.status in ("requested", "running")
    )
