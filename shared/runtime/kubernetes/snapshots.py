"""Snapshots of workspace claims as CSI VolumeSnapshots (``snapshot.storage.k8s.io/v1``),
pure: the manifest of one, and the ``SnapshotInfo`` a ready one stands for.

A VolumeSnapshot holds what the workspace claim holds (``/workspace`` and ``/.sbx``, the
shell's saved state), not the root filesystem (a stop loses that on Kubernetes too). It is
crash-consistent: the CSI driver copies the volume as it is, processes are not frozen. A
sandbox started from one gets a new claim whose ``dataSource`` is the VolumeSnapshot; the
new volume is independent once provisioned, so deleting the snapshot never breaks it.
"""

from __future__ import annotations

import hashlib
import json
import re
from datetime import UTC, datetime
from typing import Any

from shared.infrastructure.settings.kubernetes import KubernetesSettings
from shared.runtime import api
from shared.runtime.kubernetes import names

GROUP = "snapshot.storage.k8s.io"
VERSION = "v1"
PLURAL = "volumesnapshots"
KIND = "VolumeSnapshot"

_QUANTITY = re.compile(r"([0-9]+(?:\.[0-9]+)?)([KMGTPE]i?|[kmgtpe])?")
_UNITS = {
    "": 1, "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
}  # fmt: skip


def quantity_bytes(value: Any) -> int:
    """Bytes of a Kubernetes quantity (``10Gi``, ``1048576``); 0 if unreadable."""
    found = _QUANTITY.fullmatch(str(value or "").strip())
    if not found:
        return 0
    return int(float(found.group(1)) * _UNITS.get(found.group(2) or "", 1))


def manifest(snapshot_id: str, spec: api.SandboxSpec, settings: KubernetesSettings) -> dict[str, Any]:
    """The VolumeSnapshot of sandbox ``spec``'s workspace claim, as snapshot ``snapshot_id``."""
    of = {
        "sandbox_id": spec.sandbox_id,
        "image": spec.image,
        "run_as_root": spec.run_as_root,
        "writable_root": spec.writable_root,
        "parent": spec.snapshot,
    }
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "metadata": {
            "name": names.snapshot_name(snapshot_id),
            "namespace": settings.namespace,
            "labels": names.snapshot_labels(snapshot_id, spec.sandbox_id),
            "annotations": {
                names.SNAPSHOT_ID: snapshot_id,
                names.SNAPSHOT_OF: json.dumps(of, sort_keys=True),
            },
        },
        "spec": {
            "volumeSnapshotClassName": settings.snapshot_class,
            "source": {"persistentVolumeClaimName": names.claim_name(spec.sandbox_id)},
        },
    }


def data_source(snapshot_id: str) -> dict[str, str]:
    """A claim's ``dataSource``: provisioned with the snapshot's content."""
    return {"apiGroup": GROUP, "kind": KIND, "name": names.snapshot_name(snapshot_id)}


def of(obj: dict[str, Any]) -> dict[str, Any]:
    """What the snapshot was taken of (its ``SNAPSHOT_OF`` annotation)."""
    raw = (obj.get("metadata", {}).get("annotations") or {}).get(names.SNAPSHOT_OF, "{}")
    try:
        found = json.loads(raw)
    except ValueError:
        return {}
    return found if isinstance(found, dict) else {}


def ready(obj: dict[str, Any]) -> bool:
    return bool((obj.get("status") or {}).get("readyToUse"))


def failure(obj: dict[str, Any]) -> str | None:
    """Why the CSI driver could not make it, if it says so."""
    error = (obj.get("status") or {}).get("error") or {}
    return str(error.get("message")) if error.get("message") else None


def info(obj: dict[str, Any]) -> api.SnapshotInfo:
    meta, status = obj.get("metadata", {}), obj.get("status") or {}
    taken = of(obj)
    size = quantity_bytes(status.get("restoreSize"))
    created = meta.get("creationTimestamp")
    identity = f"{meta.get('uid', '')}/{status.get('boundVolumeSnapshotContentName', '')}"
    return api.SnapshotInfo(
        snapshot_id=(meta.get("annotations") or {}).get(names.SNAPSHOT_ID, meta.get("name", "")),
        sandbox_id=str(taken.get("sandbox_id", "")),
        # An identity, not a hash of the content: the API does not expose one.
        digest="sha256:" + hashlib.sha256(identity.encode()).hexdigest(),
        layers=(str(meta.get("name", "")),),
        parent=taken.get("parent"),
        size=size,
        total_size=size,
        files=0,
        image=str(taken.get("image", "default")),
        image_digest=None,
        run_as_root=bool(taken.get("run_as_root", True)),
        writable_root=bool(taken.get("writable_root", True)),
        created_at=datetime.fromisoformat(created.replace("Z", "+00:00")) if created else datetime.now(UTC),
        frozen_seconds=0.0,
    )
