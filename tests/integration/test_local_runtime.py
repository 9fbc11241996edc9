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
