"""Snapshots on Kubernetes: CSI VolumeSnapshots of the workspace claim, against the emulated
API server (emulator.py: it serves the snapshot.storage.k8s.io/v1 VolumeSnapshot resource and
plays the CSI snapshotter and provisioner: a snapshot copies the claim's volume, a claim with
a VolumeSnapshot ``dataSource`` is provisioned with that copy; pods run as local sandboxes)."""

from __future__ import annotations

import dataclasses

import kmock
import pytest

from sbx_api import errors
from shared.runtime import api
from shared.runtime.kubernetes import names
from tests.contract.runtime_contract import new_id
from tests.kubernetes.conftest import SETTINGS, needs_root

pytestmark = needs_root
WITH_SNAPSHOTS = dataclasses.replace(SETTINGS, snapshot_class="csi-hostpath-snapclass")
VOLUME_SNAPSHOTS = kmock.resource("snapshot.storage.k8s.io", "v1", "volumesnapshots")


async def started(rt, **fields) -> str:
    spec = api.SandboxSpec(sandbox_id=new_id(), **fields)
    await rt.create(spec)
    await rt.start(spec.sandbox_id)
    return spec.sandbox_id


async def sh(rt, sandbox_id: str, command: str) -> bytes:
    result, out, err = await rt.run(sandbox_id, ["sh", "-c", command])
    assert result.exit_code == 0, (command, out, err)
    return out


async def test_a_snapshot_is_a_volume_snapshot_and_a_fork_a_claim_provisioned_from_it(cluster, make_kube):
    rt = make_kube(WITH_SNAPSHOTS)
    assert rt.snapshots
    origin = await started(rt)
    await sh(rt, origin, "echo v1 > /workspace/f; mkdir -p /workspace/d && echo x > /workspace/d/x")
    taken = await rt.snapshot(origin, "snap-1")
    assert taken.snapshot_id == "snap-1" and taken.sandbox_id == origin and taken.size > 0
    assert taken.digest.startswith("sha256:") and taken.parent is None and taken.frozen_seconds == 0
    (stored,) = [o.raw for (r, _, _), o in cluster.objects.items() if r == VOLUME_SNAPSHOTS]
    assert stored["spec"] == {
        "volumeSnapshotClassName": "csi-hostpath-snapclass",
        "source": {"persistentVolumeClaimName": names.claim_name(origin)},
    }
    assert stored["metadata"]["labels"][names.SNAPSHOT] and stored["status"]["readyToUse"] is True
    assert await rt.snapshot(origin, "snap-1") == taken  # the same id again: the same snapshot
    other = await started(rt)
    with pytest.raises(errors.Conflict):
        await rt.snapshot(other, "snap-1")
    assert await rt.get_snapshot("snap-1") == taken
    assert [s.snapshot_id for s in await rt.list_snapshots()] == ["snap-1"]

    await sh(rt, origin, "echo v2 > /workspace/f")
    fork = await started(rt, snapshot="snap-1")
    claim = await rt._claim(fork)
    assert claim.spec.data_source.kind == "VolumeSnapshot"
    assert claim.spec.data_source.name == names.snapshot_name("snap-1")
    assert (await sh(rt, fork, "cat /workspace/f /workspace/d/x")).split() == [b"v1", b"x"]
    await sh(rt, fork, "echo mine > /workspace/only-fork")
    assert b"only-fork" not in await sh(rt, origin, "ls /workspace")
    assert (await sh(rt, origin, "cat /workspace/f")).strip() == b"v2"

    # Deleting the snapshot leaves the fork's volume whole; its spec must match; unknown is said.
    assert await rt.delete_snapshot("snap-1") and not await rt.delete_snapshot("snap-1")
    assert await rt.get_snapshot("snap-1") is None
    await rt.stop(fork)
    await rt.start(fork)
    assert (await sh(rt, fork, "cat /workspace/f /workspace/only-fork")).split() == [b"v1", b"mine"]
    second = await rt.snapshot(origin, "snap-2")
    with pytest.raises(errors.InvalidInput, match="run_as_root"):
        await rt.create(api.SandboxSpec(sandbox_id=new_id(), snapshot="snap-2", run_as_root=False))
    with pytest.raises(errors.NotFound, match="snapshot 'snap-1'"):
        await rt.create(api.SandboxSpec(sandbox_id=new_id(), snapshot="snap-1"))
    assert second.parent is None
    grandchild = await started(rt, snapshot="snap-2")
    assert (await rt.snapshot(grandchild, "snap-3")).parent == "snap-2"
    for sandbox_id in (origin, other, fork, grandchild):
        await rt.delete(sandbox_id)


async def test_without_a_snapshot_class_snapshots_are_refused_plainly(make_kube):
    rt = make_kube()
    assert not rt.snapshots and await rt.list_snapshots() == [] and await rt.get_snapshot("x") is None
    with pytest.raises(errors.NotBuiltYet, match="not available on this cluster.*SBX_K8S_SNAPSHOT_CLASS"):
        await rt.snapshot(new_id(), "snap-1")
    with pytest.raises(errors.NotBuiltYet, match="SBX_K8S_SNAPSHOT_CLASS"):
        await rt.create(api.SandboxSpec(sandbox_id=new_id(), snapshot="snap-1"))
