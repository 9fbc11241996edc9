"""Which sandbox backend runs sandboxes, and the limits every sandbox gets: memory, CPU,
processes, disk, network, images and snapshots."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from sbx_api import errors
from shared.infrastructure.settings import values


def egress(env: Mapping[str, str]) -> str:
    """``SBX_SANDBOX_EGRESS``: read by the runtime and by the gateway, whose tool texts say it."""
    return values.choice(env, "SBX_SANDBOX_EGRESS", "none", ("proxy", "none"))


@dataclass(frozen=True)
class RuntimeSettings:
    """Which sandbox backend the pool-manager and executor use, and its defaults."""

    backend: str = "local"
    """``local`` (bubblewrap on this machine) or ``kubernetes`` (pods; see
    :class:`KubernetesSettings`) (``SBX_RUNTIME``)."""
    memory_bytes: int = 2 * 1024**3
    """Memory limit per sandbox (``SBX_SANDBOX_MEMORY``, e.g. ``2g``, ``512m``)."""
    cpus: float = 1.0
    """CPU limit per sandbox in cores (``SBX_SANDBOX_CPUS``)."""
    pids: int = 512
    """Process limit per sandbox (``SBX_SANDBOX_PIDS``)."""
    output_limit: int = 256 * 1024
    """Most bytes of command output returned by one tool call (``SBX_OUTPUT_LIMIT``)."""
    disk_bytes: int = 10 * 1024**3
    """Disk space per sandbox: workspace, copy-on-write root and ``/.sbx`` together
    (``SBX_SANDBOX_DISK``; ``off``: none of its own). Local runtime: a filesystem of
    that size for each sandbox; filling it gives ENOSPC inside and nothing else."""
    disk_inodes: int = 500_000
    """Files and directories per sandbox (``SBX_SANDBOX_INODES``)."""
    disk_reserve: int = 2 * 1024**3
    """Free space the state filesystem keeps for the event store: no sandbox starts
    while less is free (``SBX_DISK_RESERVE``), and snapshots and image pulls stop
    before they would leave less."""
    disk_reserve_inodes: int = 10_000
    """Free inodes the state filesystem keeps, the same way (``SBX_DISK_RESERVE_INODES``)."""
    egress: str = "none"
    """Sandbox network (``SBX_SANDBOX_EGRESS``): ``proxy`` (only the credential proxy is
    reachable) or ``none`` (loopback only). ``sbx up`` chooses ``proxy`` where it can."""
    registries_file: Path | None = None
    """The operator's registry configuration (``SBX_REGISTRIES_FILE``, TOML: credentials,
    insecure registries, mirrors; see docs/images.md). Read by the services only."""
    image_max_bytes: int = 8 * 1024**3
    """Most bytes one image may download, and most it may unpack to (``SBX_IMAGE_MAX_BYTES``)."""
    image_max_layers: int = 128
    """Most layers an image may have, refused from its manifest (``SBX_IMAGE_MAX_LAYERS``)."""
    image_max_entries: int = 500_000
    """Most files, directories and links one pull may unpack (``SBX_IMAGE_MAX_ENTRIES``)."""
    pull_timeout: float = 600.0
    """Longest an image pull may take (``SBX_IMAGE_PULL_TIMEOUT``)."""
    snapshot_budget: int = 20 * 1024**3
    """Most disk the snapshot store may hold, every layer counted once
    (``SBX_SNAPSHOT_BUDGET``): a snapshot that would pass it is refused."""
    snapshots_per_session: int = 20
    """Most snapshots kept per session (``SBX_SNAPSHOTS_PER_SESSION``; 0: no limit): a new
    one past it deletes the session's oldest (``snapshot.deleted``, reason ``retention``)."""
    cgroup_favor_dynmods: bool = True
    """Local runtime: the pool-manager turns on cgroup2's ``favordynmods`` on this host
    where it is off (``SBX_CGROUP_FAVOR_DYNMODS``, true/false): every process entering a
    sandbox moves into its cgroup, 7.5-15 ms without it after a quiet moment, 0.2 with."""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> RuntimeSettings:
        backend = values.choice(env, "SBX_RUNTIME", cls.backend, ("local", "kubernetes"))
        try:
            cpus = float(env.get("SBX_SANDBOX_CPUS", cls.cpus))
            pids = int(env.get("SBX_SANDBOX_PIDS", cls.pids))
        except ValueError as exc:
            raise errors.ConfigError(f"SBX_SANDBOX_CPUS / SBX_SANDBOX_PIDS: {exc}") from None
        if not 0 < cpus <= 256 or not 8 <= pids <= 1_000_000:
            raise errors.ConfigError("SBX_SANDBOX_CPUS must be in (0, 256] and SBX_SANDBOX_PIDS in [8, 1e6]")
        return cls(
            egress=egress(env),
            backend=backend,
            memory_bytes=values.size(env, "SBX_SANDBOX_MEMORY", cls.memory_bytes, minimum=16 * 1024**2),
            cpus=cpus,
            pids=pids,
            output_limit=values.size(env, "SBX_OUTPUT_LIMIT", cls.output_limit, minimum=1024),
            disk_bytes=0
            if env.get("SBX_SANDBOX_DISK", "").strip().lower() in ("off", "0")
            else values.size(env, "SBX_SANDBOX_DISK", cls.disk_bytes, minimum=64 * 1024**2),
            disk_inodes=values.count(env, "SBX_SANDBOX_INODES", cls.disk_inodes, 1024, 100_000_000),
            disk_reserve=values.size(env, "SBX_DISK_RESERVE", cls.disk_reserve, minimum=0),
            disk_reserve_inodes=values.count(
                env, "SBX_DISK_RESERVE_INODES", cls.disk_reserve_inodes, 0, 1_000_000_000
            ),
            registries_file=Path(env["SBX_REGISTRIES_FILE"]) if env.get("SBX_REGISTRIES_FILE") else None,
            image_max_bytes=values.size(env, "SBX_IMAGE_MAX_BYTES", cls.image_max_bytes, minimum=1024**2),
            image_max_layers=values.count(env, "SBX_IMAGE_MAX_LAYERS", cls.image_max_layers, 1, 1000),
            image_max_entries=values.count(
                env, "SBX_IMAGE_MAX_ENTRIES", cls.image_max_entries, 1000, 100_000_000
            ),
            pull_timeout=values.duration(env, "SBX_IMAGE_PULL_TIMEOUT", cls.pull_timeout, minimum=1),
            snapshot_budget=values.size(env, "SBX_SNAPSHOT_BUDGET", cls.snapshot_budget, minimum=0),
            snapshots_per_session=values.count(
                env, "SBX_SNAPSHOTS_PER_SESSION", cls.snapshots_per_session, 0, 1_000_000
            ),
            cgroup_favor_dynmods=values.flag(
                {"SBX_CGROUP_FAVOR_DYNMODS": "true", **env}, "SBX_CGROUP_FAVOR_DYNMODS"
            ),
        )
