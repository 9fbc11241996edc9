"""Fixtures: the emulated API server (see emulator.py) and runtimes pointed at it."""

from __future__ import annotations

import kmock
import pytest
from kubernetes_asyncio import client

from shared.infrastructure.settings.kubernetes import KubernetesSettings
from shared.runtime.kubernetes import runtime as kube
from tests.kubernetes.emulator import ClusterEmulator

IMAGE = "ghcr.io/cloud-agent-sandbox/sandbox:test"
SETTINGS = KubernetesSettings(images=(("default", IMAGE),), start_timeout=20)

needs_root = pytest.mark.needs_root("the emulated kubelet runs pods as local sandboxes (root)")


@pytest.fixture
async def cluster(tmp_path):
    emulator = ClusterEmulator(images=frozenset({IMAGE}), state_dir=tmp_path / "kubelet")
    async with emulator, kmock.Server(emulator):
        yield emulator
        await emulator.close_all()


def configuration(cluster: ClusterEmulator) -> client.Configuration:
    return client.Configuration(host=str(cluster.url).rstrip("/"))


@pytest.fixture
async def make_kube(cluster):
    made: list[kube.KubernetesRuntime] = []

    def make(settings: KubernetesSettings = SETTINGS, **kwargs: object) -> kube.KubernetesRuntime:
        rt = kube.KubernetesRuntime(settings, configuration=configuration(cluster), **kwargs)  # type: ignore[arg-type]
        made.append(rt)
        return rt

    yield make
    for rt in made:
        await rt.close()
