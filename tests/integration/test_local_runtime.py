"""The runtime contract against the local bubblewrap runtime, with real sandboxes."""

from __future__ import annotations

import os

import pytest

from shared.runtime.local import runtime as local
from tests.contract.runtime_contract import RuntimeContract

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the local runtime's cgroup limits need root")


class TestLocalRuntime(RuntimeContract):
    @pytest.fixture
    def make_runtime(self, tmp_path):
        return lambda: local.LocalRuntime(tmp_path / "state")

    @pytest.fixture
    async def runtime(self, make_runtime):
        rt = make_runtime()
        yield rt
        for info in await rt.list():
            await rt.delete(info.sandbox_id)


async def test_a_sandbox_stopped_while_a_command_enters_it_is_not_running_not_a_crash(tmp_path, monkeypatch):
    """Entering runs after the sandbox was looked up; if it stopped or was deleted in
    between (a delete racing a run), the caller gets NotRunning, never a server error."""
    from shared.runtime import api
    from shared.runtime.local import runtime as local_runtime

    rt = local.LocalRuntime(tmp_path / "state")
    await rt.create(api.SandboxSpec(sandbox_id="racy"))
    await rt.start("racy")
    real = local_runtime.asyncio.create_subprocess_exec

    async def stopped_meanwhile(*args, **kwargs):
        await rt.stop("racy")  # as a delete would, between the lookup and the entering
        import subprocess

        raise subprocess.SubprocessError("Exception occurred in preexec_fn.")

    monkeypatch.setattr(local_runtime.asyncio, "create_subprocess_exec", stopped_meanwhile)
    with pytest.raises(api.SandboxNotRunning, match="is stopped, not running"):
        await rt.exec("racy", ["true"])
    monkeypatch.setattr(local_runtime.asyncio, "create_subprocess_exec", real)
    await rt.delete("racy")
