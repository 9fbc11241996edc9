"""Snapshots of workspace claims as CSI VolumeSnapshots, against the cluster: made, awaited,
read, listed and deleted (the manifests and what a ready one stands for are pure, in
:mod:`~shared.runtime.kubernetes.snapshots`). Off unless ``SBX_K8S_SNAPSHOT_CLASS`` names a
VolumeSnapshotClass."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from sbx_api import errors
from shared.contract import ids
from shared.infrastructure.settings.kubernetes import KubernetesSettings
from shared.runtime import api
from shared.runtime.kubernetes import cluster, names
from shared.runtime.kubernetes import snapshots as k8s_snapshots


class VolumeSnapshots:
    def __init__(self, settings: KubernetesSettings, on: cluster.Cluster) -> None:
        self.settings = settings
        self.ns = settings.namespace
        self.cluster = on

    @property
    def enabled(self) -> bool:
        return bool(self.settings.snapshot_class)

    def unavailable(self) -> errors.SandboxError:
        return errors.NotBuiltYet(
            "snapshots are not available on this cluster: they need a CSI VolumeSnapshotClass, "
            "named in SBX_K8S_SNAPSHOT_CLASS (none is configured)"
        )

    async def _get(self, snapshot_id: str) -> dict[str, Any] | None:
        custom = await self.cluster.custom()
        found = await self.cluster.call(
            "reading a VolumeSnapshot",
            custom.get_namespaced_custom_object(
                k8s_snapshots.GROUP, k8s_snapshots.VERSION, self.ns, k8s_snapshots.PLURAL,
                names.snapshot_name(snapshot_id),
            ),
            missing_ok=True,
        )  # fmt: skip
        if found is None or (found.get("metadata") or {}).get("deletionTimestamp"):
            return None
        return dict(found)

    async def take(
        self, sandbox_id: str, snapshot_id: str, spec_of: Callable[[], Awaitable[api.SandboxSpec]]
    ) -> api.SnapshotInfo:
        """A VolumeSnapshot of the sandbox's workspace claim (``/workspace`` and the shell's
        saved state; crash-consistent: the CSI driver copies the volume as it is), ready
        when this returns. Idempotent by ``snapshot_id``."""
        if not self.enabled:
            raise self.unavailable()
        ids.validate_session_id(snapshot_id, what="snapshot id")
        existing = await self._get(snapshot_id)
        if existing is not None and k8s_snapshots.of(existing).get("sandbox_id") != sandbox_id:
            raise errors.Conflict(f"snapshot id {snapshot_id!r} is taken by another sandbox")
        if existing is None:
            custom = await self.cluster.custom()
            body = k8s_snapshots.manifest(snapshot_id, await spec_of(), self.settings)
            try:
                await self.cluster.call(
                    "creating a VolumeSnapshot",
                    custom.create_namespaced_custom_object(
                        k8s_snapshots.GROUP, k8s_snapshots.VERSION, self.ns, k8s_snapshots.PLURAL, body
                    ),
                )
            except errors.NotFound:
                raise errors.ConfigError(
                    "this cluster does not serve snapshot.storage.k8s.io/v1 VolumeSnapshots: install "
                    "the CSI snapshot CRDs and controller, or unset SBX_K8S_SNAPSHOT_CLASS"
                ) from None
            except errors.Conflict:
                pass  # another request made it: wait for it with them
        return k8s_snapshots.info(await self._until_ready(snapshot_id))

    async def _until_ready(self, snapshot_id: str) -> dict[str, Any]:
        deadline = time.monotonic() + self.settings.start_timeout
        delay = 0.05
        while True:
            found = await self._get(snapshot_id)
            if found is None:
                raise errors.NotFound(f"snapshot {snapshot_id!r} was deleted while it was being made")
            if k8s_snapshots.ready(found):
                return found
            if (why := k8s_snapshots.failure(found)) is not None:
                raise errors.InfrastructureError(f"the CSI driver could not snapshot the workspace: {why}")
            if time.monotonic() > deadline:
                raise errors.Unavailable(
                    f"snapshot {snapshot_id!r} is not ready after {self.settings.start_timeout:.0f} s; "
                    "retry with the same id"
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def get(self, snapshot_id: str) -> api.SnapshotInfo | None:
        if not self.enabled:
            return None
        found = await self._get(snapshot_id)
        return k8s_snapshots.info(found) if found is not None and k8s_snapshots.ready(found) else None

    async def list(self) -> list[api.SnapshotInfo]:
        if not self.enabled:
            return []
        custom = await self.cluster.custom()
        found = await self.cluster.call(
            "listing VolumeSnapshots",
            custom.list_namespaced_custom_object(
                k8s_snapshots.GROUP, k8s_snapshots.VERSION, self.ns, k8s_snapshots.PLURAL,
                label_selector=names.SNAPSHOT_SELECTOR,
            ),
        )  # fmt: skip
        items = [i for i in found.get("items", []) if k8s_snapshots.ready(i)]
        return sorted((k8s_snapshots.info(i) for i in items), key=lambda s: (s.created_at, s.snapshot_id))

    async def delete(self, snapshot_id: str) -> bool:
        """Delete the VolumeSnapshot. Claims provisioned from it are volumes of their own."""
        if not self.enabled:
            return False
        custom = await self.cluster.custom()
        gone = await self.cluster.call(
            "deleting a VolumeSnapshot",
            custom.delete_namespaced_custom_object(
                k8s_snapshots.GROUP, k8s_snapshots.VERSION, self.ns, k8s_snapshots.PLURAL,
                names.snapshot_name(snapshot_id),
            ),
            missing_ok=True,
        )  # fmt: skip
        return gone is not None

    async def check_usable(self, spec: api.SandboxSpec) -> None:
        """A sandbox may start from ``spec.snapshot``: it exists, is ready, and was taken of
        a sandbox like this one."""
        if not self.enabled:
            raise self.unavailable()
        assert spec.snapshot is not None
        found = await self._get(spec.snapshot)
        if found is None or not k8s_snapshots.ready(found):
            raise errors.NotFound(f"snapshot {spec.snapshot!r} does not exist (or is not ready)")
        taken = k8s_snapshots.of(found)
        differs = [
            f"{name} {taken.get(name)!r}"
            for name, ours in (
                ("image", spec.image),
                ("run_as_root", spec.run_as_root),
                ("writable_root", spec.writable_root),
            )
            if taken.get(name) != ours
        ]
        if differs:
            raise errors.InvalidInput(
                f"a sandbox from snapshot {spec.snapshot!r} has its snapshot's {', '.join(differs)}"
            )
