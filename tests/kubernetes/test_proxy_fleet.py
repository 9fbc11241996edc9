"""The proxy fleet on Kubernetes: proxy-scaler, scheduler and pool-manager in-process over a
real nats-server, with the Kubernetes runtime against the emulated API server
(emulator.py: kmock with its gaps filled; sandbox pods are real local sandboxes, proxy
pods are reported ready but run nothing; the Deployment and Service come from
deploy/kubernetes/base/proxy.yaml). 0 proxies without sandboxes, about one per N, a
deleted proxy pod recorded as died and replaced, back to 0; sandboxes get the Service's
address and the CA from the ConfigMap."""

from __future__ import annotations

import copy
from pathlib import Path

import kmock
import pytest
import yaml

from services.pool_manager import app as pool_app
from services.proxy_scaler import app as scaler_app
from services.scheduler import app as scheduler_app
from shared.contract import commands, ids, subjects
from shared.domain import projections
from shared.infrastructure import eventstore, projector
from shared.infrastructure.settings import kubernetes, lifecycle, proxies
from shared.infrastructure.settings import runtime as runtime_settings
from shared.runtime.kubernetes import runtime as kube
from tests import support
from tests.kubernetes import test_rbac
from tests.kubernetes.conftest import IMAGE, configuration, needs_root
from tests.kubernetes.test_services_on_kubernetes import kubeconfig

pytestmark = [needs_root, pytest.mark.slow]
PROXY_YAML = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "base" / "proxy.yaml"
RUNTIME = runtime_settings.RuntimeSettings(backend="kubernetes", memory_bytes=256 * 1024**2, egress="proxy")
LIFECYCLE = lifecycle.LifecycleSettings(pool_min_idle=0, max_running=20)
FLEET = proxies.ProxySettings(sandboxes_per_proxy=2, drain=0.5, keep_warm=0)
CA = "-----BEGIN CERTIFICATE-----\nMIIBtestproxyca\n-----END CERTIFICATE-----\n"


async def install(cluster) -> None:
    """What deploy/ and the operator put in place: the proxy Deployment and Service, the CA."""
    for doc in yaml.safe_load_all(PROXY_YAML.read_text()):
        if doc and doc["kind"] == "Deployment":
            cluster.images |= {c["image"] for c in doc["spec"]["template"]["spec"]["containers"]}
            await cluster.insert(kmock.resource("apps", "v1", "deployments"), copy.deepcopy(doc))
        if doc and doc["kind"] == "Service":
            service = copy.deepcopy(doc)
            service["spec"]["clusterIP"] = "10.96.0.20"
            await cluster.insert(kmock.resource("", "v1", "services"), service)
    ca = {"apiVersion": "v1", "kind": "ConfigMap", "data": {"proxy-ca.pem": CA},
          "metadata": {"name": "sbx-proxy-ca", "namespace": "sbx-sandboxes"}}  # fmt: skip
    await cluster.insert(kmock.resource("", "v1", "configmaps"), ca)


@pytest.fixture
async def fleet(cluster, nats_server, namespace, tmp_path, monkeypatch):
    config = tmp_path / "kubeconfig"
    config.write_text(kubeconfig(str(cluster.url).rstrip("/")))
    monkeypatch.setenv("KUBECONFIG", str(config))
    monkeypatch.setenv("SBX_K8S_IMAGES", f"default={IMAGE}")
    await install(cluster)
    setups = [
        ("proxy-scaler", scaler_app.make_setup(RUNTIME, FLEET)),
        ("scheduler", scheduler_app.make_setup(LIFECYCLE)),
        ("pool-manager", pool_app.make_setup(RUNTIME, LIFECYCLE)),
    ]
    running = [
        await support.start_in_process(nats_server.url, namespace, name, setup, state_dir=tmp_path / "state")
        for name, setup in setups
    ]
    nc, topology = await support.connect(nats_server.url, namespace)
    store = eventstore.EventStore(nc.jetstream(), topology)
    rt = kube.KubernetesRuntime(
        kubernetes.KubernetesSettings.from_env({}), configuration=configuration(cluster)
    )
    world = {
        "cluster": cluster, "nc": nc, "topology": topology, "rt": rt,
        "proxies": await projector.ProjectionStore.open(nc.jetstream(), projections.PROXIES, store),
    }  # fmt: skip
    yield world
    for r in reversed(running):
        await r.stop()
    await nc.close()
    for info in await rt.list():
        await rt.delete(info.sandbox_id)
    await rt.close()


async def send(world, command) -> commands.Reply:
    reply = await support.send(world["nc"], world["topology"], command, timeout=60)
    assert reply.ok, reply.error
    return reply


def replicas(world) -> int:
    _, deployment = world["cluster"]._find("deployments", "sbx-system", "sbx-proxy")
    return int(deployment.raw["spec"]["replicas"])


def proxy_pods(world) -> list[str]:
    return sorted(
        k[2] for k, o in world["cluster"].objects.items()
        if k[0].plural == "pods" and k[1] == "sbx-system" and not o.deleted
        and not o.raw["metadata"].get("deletionTimestamp")
    )  # fmt: skip


async def recorded(world) -> list:
    return sorted(p.proxy_id for p in (await world["proxies"].all()).values() if p.status == "running")


async def test_the_deployment_follows_the_sandboxes(fleet):
    await support.eventually(lambda: replicas(fleet) == 0 and proxy_pods(fleet) == [], timeout=30)

    sandboxes = []
    for n in range(3):
        reply = await send(fleet, commands.EnsureSession(command_id=ids.new_id(), session_id=f"k{n}"))
        sandboxes.append(reply.session.sandbox_id)
    await support.eventually(lambda: replicas(fleet) == 2, timeout=30)  # ceil(3 / 2)
    pods = await support.eventually(lambda: len(proxy_pods(fleet)) == 2 and proxy_pods(fleet), timeout=30)

    async def all_recorded():
        return await recorded(fleet) == pods

    await support.eventually(all_recorded, timeout=30)
    starts = [e.event for e in await support.stream_events(fleet["nc"], fleet["topology"], subjects.PROXY)]
    assert {e.backend for e in starts if e.__struct_config__.tag == "proxy.started"} == {"kubernetes"}

    # Sandboxes reach the Service's address, with the CA from the ConfigMap in their bundle.
    _, out, _ = await fleet["rt"].run(sandboxes[0], ["sh", "-c", 'echo "$HTTPS_PROXY"; cat "$SSL_CERT_FILE"'])
    assert out.decode().startswith("http://10.96.0.20:3128\n") and CA in out.decode()

    # A proxy pod that goes away is recorded as died; the Deployment replaces it.
    core = await fleet["rt"].cluster.core()
    await core.delete_namespaced_pod(pods[0], "sbx-system")

    async def replaced():
        now = await recorded(fleet)
        return pods[0] not in now and len(now) == 2

    await support.eventually(replaced, timeout=30)
    history = [e.event for e in await support.stream_events(fleet["nc"], fleet["topology"], subjects.PROXY)]
    assert any(getattr(e, "reason", None) == "died" and e.proxy_id == pods[0] for e in history)

    for n in range(3):
        await send(fleet, commands.DeleteSession(command_id=ids.new_id(), session_id=f"k{n}"))
    await support.eventually(lambda: replicas(fleet) == 0 and proxy_pods(fleet) == [], timeout=30)

    async def none_recorded():
        return await recorded(fleet) == []

    await support.eventually(none_recorded, timeout=30)
    history = [e.event for e in await support.stream_events(fleet["nc"], fleet["topology"], subjects.PROXY)]
    assert any(getattr(e, "reason", None) == "drained" for e in history)

    scaler_calls = [  # the proxy-scaler's (the test deleted a pod itself)
        c for c in fleet["cluster"].calls
        if c[2] == "sbx-system" and c[1] in ("apps/deployments", "apps/deployments/scale", "pods")
        and c != ("delete", "pods", "sbx-system")
    ]  # fmt: skip
    test_rbac.check(scaler_calls, "sbx-proxy-scaler")
