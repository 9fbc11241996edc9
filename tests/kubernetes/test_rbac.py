"""Least privilege, checked against the code: every call a service's runtime makes to the
(emulated, see emulator.py) API server is allowed by the Role deploy/ binds to that
service, and every rule in those Roles is used by some call."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import kmock
import pytest
import yaml

from sbx_api import errors
from shared.contract import ids
from shared.runtime import api
from tests.contract.runtime_contract import new_id
from tests.kubernetes.conftest import SETTINGS, needs_root

pytestmark = needs_root
RBAC = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "base" / "rbac.yaml"
UNUSED_BY_DESIGN = {("get", "pods/exec")}
"""pods/exec ``get``: API servers before the websocket-upgrade check want it instead of create."""


def role(name: str) -> dict:
    for doc in yaml.safe_load_all(RBAC.read_text()):
        if doc and doc["kind"] == "Role" and doc["metadata"]["name"] == name:
            return doc
    raise AssertionError(f"no Role {name} in {RBAC}")


def grants(doc: dict) -> set[tuple[str, str, str]]:
    """(verb, group/resource, namespace) the Role allows."""
    out = set()
    for rule in doc["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    out.add((verb, f"{group}/{resource}".lstrip("/"), doc["metadata"]["namespace"]))
    return out


def check(calls: list[tuple[str, str, str | None]], *names: str) -> None:
    allowed = set().union(*(grants(role(n)) for n in names))
    made = set(calls)
    assert made <= allowed, f"calls the Roles {names} do not allow: {sorted(made - allowed)}"
    unused = {(v, r) for v, r, _ in allowed - made} - UNUSED_BY_DESIGN
    assert not unused, f"rules no call uses (not least privilege): {sorted(unused)}"


async def test_the_lifecycle_role_allows_exactly_what_the_pool_manager_does(cluster, make_kube):
    rt = make_kube(
        dataclasses.replace(
            SETTINGS, namespace="sbx-sandboxes", cache_storage_class="nfs", snapshot_class="csi-snapclass"
        )
    )
    cluster.objects[kmock.resource("", "v1", "services"), "sbx-system", "sbx-proxy"] = {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "sbx-proxy", "namespace": "sbx-system"},
        "spec": {"clusterIP": "10.96.0.20", "ports": [{"port": 3128}]},
    }  # fmt: skip
    # (an organisation's pool sandbox: its package cache claim is made with it)
    spec = api.SandboxSpec(sandbox_id=new_id(), labels={"pool": "default"}, cache=ids.token("acme"))
    await rt.create(spec)
    await rt.start(spec.sandbox_id)
    await rt.run(spec.sandbox_id, ["sh", "-c", "sleep 30"], timeout=0.3)  # the warm-up probe, with a kill
    assert await rt.get(spec.sandbox_id) is not None
    await rt.list({"pool": "default"})
    await rt.snapshot(spec.sandbox_id, "rbac-snap")  # a VolumeSnapshot: read, made, waited for
    await rt.delete_snapshot("rbac-snap")
    await rt.stop(spec.sandbox_id)
    await rt.delete(spec.sandbox_id)
    assert await rt.cluster.proxy_url() == "http://10.96.0.20:3128"
    calls = [c for c in cluster.calls if c[1] != "services"]
    check(calls, "sbx-lifecycle")
    service_calls = [c for c in cluster.calls if c[1] == "services"]
    assert service_calls == [("get", "services", "sbx-system")]
    check(service_calls, "sbx-proxy-reader")
    (rule,) = role("sbx-proxy-reader")["rules"]
    assert rule["resourceNames"] == ["sbx-proxy"]


async def test_the_exec_role_allows_exactly_what_the_executor_does(cluster, make_kube):
    owner = make_kube(dataclasses.replace(SETTINGS, namespace="sbx-sandboxes"))
    spec = api.SandboxSpec(sandbox_id=new_id())
    await owner.create(spec)
    await owner.start(spec.sandbox_id)
    before = len(cluster.calls)
    executor = make_kube(dataclasses.replace(SETTINGS, namespace="sbx-sandboxes", cache_storage_class="nfs"))
    with pytest.raises(errors.NotBuiltYet):  # a session's first call asks for its cache
        await executor.attach_cache(spec.sandbox_id, ids.token("acme"))
    await executor.run(spec.sandbox_id, ["echo", "hi"])
    await executor.run(spec.sandbox_id, ["sleep", "30"], timeout=0.3)
    executing = cluster.calls[before:]
    await owner.stop(spec.sandbox_id)
    before = len(cluster.calls)
    with pytest.raises(errors.NotRunning):
        await executor.exec(spec.sandbox_id, ["true"])
    executing += cluster.calls[before:]
    check(executing, "sbx-exec")
    await owner.delete(spec.sandbox_id)


async def test_the_reaper_role_allows_exactly_what_the_sweep_does(cluster, make_kube):
    owner = make_kube(dataclasses.replace(SETTINGS, namespace="sbx-sandboxes"))
    specs = [api.SandboxSpec(sandbox_id=new_id()) for _ in range(2)]
    for spec in specs:
        await owner.create(spec)
    await owner.start(specs[0].sandbox_id)  # one running, one never started
    before = len(cluster.calls)
    reaper = make_kube(
        dataclasses.replace(SETTINGS, namespace="sbx-sandboxes", snapshot_class="csi-snapclass")
    )
    for info in await reaper.list():
        await reaper.delete(info.sandbox_id)
    assert await reaper.list_snapshots() == []  # the sweep's look for snapshots no event names
    assert not await reaper.delete_snapshot("stray")
    await reaper.delete(specs[0].sandbox_id)  # again: already gone
    assert await reaper.list() == []
    check(cluster.calls[before:], "sbx-reaper")


def test_roles_are_bound_to_the_services_that_need_them():
    bindings = {}
    for doc in yaml.safe_load_all(RBAC.read_text()):
        if doc and doc["kind"] == "RoleBinding":
            accounts = {s["name"] for s in doc["subjects"] if s["kind"] == "ServiceAccount"}
            bindings.setdefault(doc["roleRef"]["name"], set()).update(accounts)
    assert bindings["sbx-lifecycle"] == {"sbx-pool-manager"}
    assert bindings["sbx-reaper"] == {"sbx-reaper"}
    assert bindings["sbx-exec"] == {"sbx-executor"}
    assert bindings["sbx-proxy-reader"] == {"sbx-pool-manager"}
    everyone = set().union(*bindings.values())
    assert not {"sbx-gateway", "sbx-scheduler"} & everyone, "gateway and scheduler never talk to Kubernetes"
    kinds = {doc["kind"] for doc in yaml.safe_load_all(RBAC.read_text()) if doc}
    assert not {"ClusterRole", "ClusterRoleBinding"} & kinds, "nothing cluster-wide"
