"""The runtime contract against the Kubernetes runtime, talking HTTP and the pods/exec
websocket to the emulated API server in emulator.py (kmock with its gaps filled; each pod
runs as a real local sandbox, so every command really executes)."""

from __future__ import annotations

import pytest

from tests.contract.runtime_contract import RuntimeContract
from tests.kubernetes.conftest import needs_root

pytestmark = needs_root


class TestKubernetesRuntime(RuntimeContract):
    @pytest.fixture
    def make_runtime(self, make_kube):
        return make_kube

    @pytest.fixture
    async def runtime(self, make_runtime):
        rt = make_runtime()
        yield rt
        for info in await rt.list():
            await rt.delete(info.sandbox_id)
