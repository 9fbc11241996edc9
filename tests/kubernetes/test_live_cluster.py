"""The runtime contract against a real cluster. Runs only when ``KUBECONFIG`` names one
with deploy/ applied (namespaces, RuntimeClasses, the proxy Service); the settings come
from the usual ``SBX_K8S_*`` variables (e.g. ``SBX_K8S_RUNTIME_CLASS=`` on a cluster
without gVisor, ``SBX_K8S_IMAGES=default=<your sandbox image>``). How to run it:
deploy/README.md, "End-to-end tests on a live cluster"."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from shared.infrastructure.settings.kubernetes import KubernetesSettings
from shared.runtime.kubernetes import runtime as kube
from tests.contract.runtime_contract import RuntimeContract


def _why_skip() -> str | None:
    config = os.environ.get("KUBECONFIG", "")
    if config and Path(config).is_file():
        return None
    docker = shutil.which("docker") or Path("/var/run/docker.sock").exists()
    return (
        "no live cluster: set KUBECONFIG to a cluster with deploy/kubernetes applied (deploy/README.md)"
        + ("" if docker else "; there is no Docker engine here for a throwaway k3s either")
    )


pytestmark = pytest.mark.skipif(_why_skip() is not None, reason=_why_skip() or "")


class TestLiveCluster(RuntimeContract):
    @pytest.fixture
    def make_runtime(self):
        made = []

        def make():
            rt = kube.KubernetesRuntime(KubernetesSettings.from_env(os.environ))
            made.append(rt)
            return rt

        yield make

    @pytest.fixture
    async def runtime(self, make_runtime):
        rt = make_runtime()
        yield rt
        for info in await rt.list({"suite": "contract"}):
            await rt.delete(info.sandbox_id)
        await rt.close()
