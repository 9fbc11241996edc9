"""Pause on Kubernetes: scale to zero with the claim kept, against the emulated API server
(emulator.py: kmock with its gaps filled; pods run as real local sandboxes). Files survive
a pause, processes do not (a pod cannot be frozen through the API)."""

from __future__ import annotations

import pytest

from sbx_api import errors
from shared.runtime import api
from shared.runtime.kubernetes import names
from tests.contract.runtime_contract import new_id
from tests.kubernetes.conftest import needs_root

pytestmark = needs_root


async def test_a_paused_sandbox_has_no_pod_keeps_its_files_and_resumes(cluster, make_kube):
    rt = make_kube()
    sid = new_id()
    await rt.create(api.SandboxSpec(sandbox_id=sid))
    await rt.start(sid)
    result, _, _ = await rt.run(sid, ["sh", "-c", "echo kept > /workspace/k"])
    assert result.exit_code == 0 and rt.pausable

    paused = await rt.pause(sid)
    assert paused.status == "paused" and await rt.paused(sid)
    assert await rt._pod(sid) is None  # scaled to zero
    claim = await rt._claim(sid)
    assert claim is not None and claim.metadata.annotations[names.PAUSED] == "true"
    assert (await rt.pause(sid)).status == "paused"  # again: nothing to do
    with pytest.raises(errors.NotRunning, match="paused"):
        await rt.run(sid, ["true"])
    again = make_kube()  # a restarted service sees it paused
    assert (await again.get(sid)).status == "paused"
    assert [i.status for i in await again.list() if i.sandbox_id == sid] == ["paused"]

    resumed = await rt.resume(sid)
    assert resumed.status == "running" and not await rt.paused(sid)
    result, out, _ = await rt.run(sid, ["cat", "/workspace/k"])
    assert (result.exit_code, out) == (0, b"kept\n")
    assert (await rt.resume(sid)).status == "running"  # running: nothing to do

    # start resumes too; stop leaves it stopped, not paused; stopped cannot be paused.
    await rt.pause(sid)
    assert (await rt.start(sid)).status == "running" and not await rt.paused(sid)
    await rt.pause(sid)
    assert (await rt.stop(sid)).status == "stopped" and not await rt.paused(sid)
    with pytest.raises(errors.NotRunning):
        await rt.pause(sid)
    with pytest.raises(errors.NotRunning):
        await rt.resume(sid)
    await rt.delete(sid)
    assert await rt.get(sid) is None
