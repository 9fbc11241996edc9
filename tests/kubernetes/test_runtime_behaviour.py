"""What the Kubernetes runtime does beyond the shared contract, against the emulated API
server (emulator.py: kmock with its gaps filled; pods run as real local sandboxes)."""

from __future__ import annotations

import asyncio
import dataclasses

import kmock
import pytest

from sbx_api import errors
from shared.contract import ids
from shared.runtime import api
from shared.runtime.kubernetes import names
from tests import support
from tests.contract.runtime_contract import new_id
from tests.kubernetes.conftest import SETTINGS, needs_root

pytestmark = needs_root


async def started(rt, **spec_fields) -> str:
    spec = api.SandboxSpec(sandbox_id=new_id(), **spec_fields)
    await rt.create(spec)
    await rt.start(spec.sandbox_id)
    return spec.sandbox_id


async def test_a_v4_only_server_still_takes_one_shot_stdin_and_says_why_it_cannot_close_stdin(
    cluster, make_kube
):
    cluster.protocols = ("v4.channel.k8s.io",)
    rt = make_kube()
    sid = await started(rt)
    result, out, _ = await rt.run(sid, ["cat"], stdin=b"\x00\xffbinary\n")
    assert (result.exit_code, out) == (0, b"\x00\xffbinary\n")
    helper = await rt.exec(sid, ["sh", "-c", "read -r x; echo got $x"], keep_stdin_open=True)
    await helper.send(b"one\n")
    assert [d async for _, d in helper.chunks()] == [b"got one\n"]
    with pytest.raises(errors.Unavailable, match="v4"):
        await helper.close_stdin()
    assert (await helper.wait()).exit_code == 0
    await rt.delete(sid)


async def test_a_timeout_kills_what_the_command_started_even_a_new_session(make_kube):
    rt = make_kube()
    sid = await started(rt)
    script = "setsid sleep 300 & sleep 300 & echo started; wait"
    result, out, _ = await rt.run(sid, ["sh", "-c", script], timeout=1.0)
    assert result.timed_out and out == b"started\n"
    _, ps, _ = await rt.run(sid, ["sh", "-c", "ps -e -o comm= | grep -c '^sleep$' || true"])
    assert ps.strip() == b"0"
    running = await rt.exec(sid, ["sleep", "300"])
    await running.kill()
    assert (await asyncio.wait_for(running.wait(), 10)).exit_code == 128 + 9
    await rt.delete(sid)


async def test_an_image_that_cannot_be_pulled_fails_the_start_with_the_reason(make_kube):
    rt = make_kube(
        dataclasses.replace(SETTINGS, images=(("default", "registry.example/missing:1"),), start_timeout=2)
    )
    spec = api.SandboxSpec(sandbox_id=new_id())
    await rt.create(spec)
    with pytest.raises(errors.Timeout, match="ErrImagePull"):
        await rt.start(spec.sandbox_id)
    assert (await rt.get(spec.sandbox_id)).status != "running"
    await rt.delete(spec.sandbox_id)


async def test_a_failing_pull_fails_the_start_within_the_grace_with_the_registrys_reason(
    make_kube, monkeypatch
):
    """The kubelet keeps retrying a pull that fails (ErrImagePull, then ImagePullBackOff);
    the start gives up after PULL_GRACE, not after the whole SBX_K8S_START_TIMEOUT."""
    from shared.runtime.kubernetes import runtime as kube

    monkeypatch.setattr(kube, "PULL_GRACE", 0.3)
    rt = make_kube(dataclasses.replace(SETTINGS, start_timeout=60))
    spec = api.SandboxSpec(sandbox_id=new_id(), image="registry.example/team/missing:1")
    await rt.create(spec)
    started_at = asyncio.get_running_loop().time()
    with pytest.raises(
        errors.InvalidInput, match=r"cannot be pulled \(ErrImagePull: .*registry.example/team/missing:1"
    ):
        await rt.start(spec.sandbox_id)
    assert asyncio.get_running_loop().time() - started_at < 30
    await rt.delete(spec.sandbox_id)


def test_any_reference_goes_into_the_pod_spec_and_aliases_are_resolved():
    from shared.runtime.kubernetes import manifests

    settings = dataclasses.replace(SETTINGS, image_pull_secrets=("regcred",))
    assert settings.image("default") == dict(SETTINGS.images)["default"]
    assert settings.image("ghcr.io/org/tool@sha256:" + "a" * 64) == "ghcr.io/org/tool@sha256:" + "a" * 64
    pod = manifests.pod(
        api.SandboxSpec(sandbox_id="s1", image="python:3.12"),
        {"metadata": {"name": "c", "uid": "u"}},
        settings,
        image="python:3.12",
        proxy_url="http://p:3128",
    )
    assert pod["spec"]["containers"][0]["image"] == "python:3.12"
    assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}]


async def test_an_expired_watch_is_resumed_from_a_fresh_list(cluster, make_kube):
    rt = make_kube()
    sid = await started(rt)
    cluster.expire_history()
    lists_before = sum(1 for verb, what, _ in cluster.calls if (verb, what) == ("list", "pods"))
    stopped = await rt.stop(sid)
    assert stopped.status == "stopped"
    lists_after = sum(1 for verb, what, _ in cluster.calls if (verb, what) == ("list", "pods"))
    assert lists_after > lists_before, "the 410 made the runtime list again"
    await rt.delete(sid)


async def test_two_instances_starting_one_sandbox_make_one_pod(cluster, make_kube):
    first, second = make_kube(), make_kube()
    spec = api.SandboxSpec(sandbox_id=new_id())
    await first.create(spec)
    a, b = await asyncio.gather(first.start(spec.sandbox_id), second.start(spec.sandbox_id))
    assert a.status == b.status == "running"
    creates = [c for c in cluster.calls if c[:2] == ("create", "pods")]
    assert len(creates) == 2, "both tried"
    pods = [k for k, o in cluster.objects.items() if k[0].plural == "pods" and not o.deleted]
    assert len(pods) == 1
    await first.delete(spec.sandbox_id)


async def test_delete_leaves_nothing_in_the_cluster_or_on_the_node(cluster, make_kube):
    rt = make_kube()
    sid = await started(rt, labels={"session": "with spaces & symbols"})
    assert [i.sandbox_id for i in await rt.list({"session": "with spaces & symbols"})] == [sid]
    await rt.delete(sid)
    for _ in range(100):
        alive = [k for k, o in cluster.objects.items() if not o.deleted]
        if not alive:
            break
        await asyncio.sleep(0.05)
    assert alive == []
    assert await cluster._runtime.list() == []


async def test_api_errors_become_the_projects_errors(cluster, make_kube):
    rt = make_kube()
    cluster["post", kmock.resource("", "v1", "persistentvolumeclaims")] << 403
    with pytest.raises(errors.ConfigError, match="RBAC"):
        await rt.create(api.SandboxSpec(sandbox_id=new_id()))
    with pytest.raises(errors.InvalidInput, match="not a valid registry host|repository names"):
        await rt.create(api.SandboxSpec(sandbox_id=new_id(), image="Python Image"))
    with pytest.raises(errors.NotBuiltYet, match="SBX_K8S_STRONG_RUNTIME_CLASS"):
        await make_kube(dataclasses.replace(SETTINGS, strong_runtime_class="")).create(
            api.SandboxSpec(sandbox_id=new_id(), isolation="strong")
        )


async def test_an_unreachable_api_server_is_unavailable_not_a_crash(make_kube):
    from kubernetes_asyncio import client

    from shared.runtime.kubernetes import runtime as kube

    rt = kube.KubernetesRuntime(SETTINGS, configuration=client.Configuration(host="http://127.0.0.1:9"))
    with pytest.raises(errors.Unavailable):
        await rt.get("anything")
    await rt.close()


async def test_objects_carry_the_session_labels_and_the_id_annotation(cluster, make_kube):
    rt = make_kube()
    sid = await started(rt, labels={"session": "s1", "pool": "default"})
    for (resource, _, _), obj in cluster.objects.items():
        if obj.deleted:
            continue
        labels = obj.raw["metadata"]["labels"]
        assert labels["label.sbx.dev/session"] == "s1" and labels[names.MANAGED_BY] == names.PRODUCT, resource
    await rt.delete(sid)


async def test_a_timeout_returns_even_when_a_survivor_holds_the_output_open(make_kube):
    """``env -i`` clears the marker the killer looks for: that process survives, keeps
    stdout open, and the call still ends (the stream is closed after a grace period)."""
    rt = make_kube()
    sid = await started(rt)
    result, _, _ = await rt.run(sid, ["sh", "-c", "env -i sleep 300 & sleep 300"], timeout=1.0)
    assert result.timed_out and result.exit_code == -1
    await rt.delete(sid)


async def test_a_claim_deleted_in_the_background_under_its_pod_is_swept_not_leaked(cluster, make_kube):
    """``kubectl delete pvc`` (background propagation) while the pod runs: pvc-protection
    keeps the claim and the garbage collector waits for it, forever. The sandbox's pod
    shows up in ``list`` as an orphan, and deleting it frees both."""
    rt = make_kube()
    sid = await started(rt)
    core = await rt.cluster.core()
    await core.delete_namespaced_persistent_volume_claim(names.claim_name(sid), SETTINGS.namespace)
    assert await rt.get(sid) is None, "a claim being deleted is no sandbox"
    assert sid in {i.sandbox_id for i in await rt.list()}, "its pod is listed for the sweep"
    await rt.delete(sid)

    def gone():
        return not [k for k, o in cluster.objects.items() if not o.deleted]

    await support.eventually(gone, timeout=20)


async def test_a_stale_network_policy_of_an_earlier_claim_is_replaced_not_adopted(cluster, make_kube):
    rt = make_kube()
    spec = api.SandboxSpec(sandbox_id=new_id())
    stale = {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": names.object_name(spec.sandbox_id), "namespace": SETTINGS.namespace,
                     "ownerReferences": [{"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                                          "name": names.claim_name(spec.sandbox_id), "uid": "an-old-claim"}]},
        "spec": {"podSelector": {}, "policyTypes": ["Egress"], "egress": [{}]},
    }  # fmt: skip
    await cluster.insert(kmock.resource("networking.k8s.io", "v1", "networkpolicies"), stale)
    claim = await rt.create(spec)
    await rt.start(spec.sandbox_id)
    _, policy = cluster._find("networkpolicies", SETTINGS.namespace, names.object_name(spec.sandbox_id))
    raw = policy.raw
    assert raw["metadata"]["ownerReferences"][0]["uid"] != "an-old-claim"
    assert raw["spec"]["egress"] == [], "the sandbox's own policy (egress none), not the allow-all one"
    assert claim.status == "created"
    await rt.delete(spec.sandbox_id)


async def test_the_trust_bundle_is_made_on_start_and_again_after_a_start_that_died(cluster, make_kube):
    """Proxy egress: the CA (from its ConfigMap) goes into the bundle every tool uses; a
    start that finds the pod running finishes the job if it was never done."""
    service = {"apiVersion": "v1", "kind": "Service", "spec": {"clusterIP": "10.96.0.20"},
               "metadata": {"name": "sbx-proxy", "namespace": "sbx-system"}}  # fmt: skip
    ca = "-----BEGIN CERTIFICATE-----\nMIIBtestca\n-----END CERTIFICATE-----\n"
    configmap = {"apiVersion": "v1", "kind": "ConfigMap", "data": {"proxy-ca.pem": ca},
                 "metadata": {"name": "sbx-proxy-ca", "namespace": SETTINGS.namespace}}  # fmt: skip
    await cluster.insert(kmock.resource("", "v1", "services"), service)
    await cluster.insert(kmock.resource("", "v1", "configmaps"), configmap)
    rt = make_kube(egress="proxy")
    sid = await started(rt)
    _, out, _ = await rt.run(sid, ["sh", "-c", 'echo "$HTTPS_PROXY"; cat "$SSL_CERT_FILE"'])
    assert out.decode().startswith("http://10.96.0.20:3128\n") and ca in out.decode()
    await rt.run(sid, ["sh", "-c", 'rm -f "$SSL_CERT_FILE"'])  # as if the first start died before it
    assert (await rt.start(sid)).status == "running"
    _, out, _ = await rt.run(sid, ["sh", "-c", 'cat "$SSL_CERT_FILE"'])
    assert ca in out.decode()
    await rt.delete(sid)


CACHED = dataclasses.replace(SETTINGS, cache_storage_class="shared-nfs", cache_size="5Gi")


def cache_claims(cluster) -> dict[str, dict]:
    return {
        name: obj.raw
        for (resource, _, name), obj in cluster.objects.items()
        if resource.plural == "persistentvolumeclaims" and name.startswith("sbx-cache-") and not obj.deleted
    }


async def cache_file(rt, sandbox_id: str) -> str:
    _, out, _ = await rt.run(sandbox_id, ["sh", "-c", "cat /.sbx/cache/marker 2>/dev/null || echo none"])
    return out.decode().strip()


async def test_an_organisations_sandboxes_share_its_cache_volume_and_no_other_sees_it(cluster, make_kube):
    """Per-tenant package caches on Kubernetes: one ReadWriteMany claim per organisation,
    made with its first sandbox and mounted by every pod of that organisation at
    /.sbx/cache (package tools pointed there), never by another organisation's pods; it is
    not a sandbox (not listed, not swept) and outlives the sandboxes. The emulated kubelet
    shares a claim between the pods that mount it, as a ReadWriteMany volume does."""
    rt = make_kube(CACHED)
    acme, globex = ids.token("acme"), ids.token("globex")
    a1 = await started(rt, cache=acme)
    a2 = await started(rt, cache=acme)
    g1 = await started(rt, cache=globex)
    plain = await started(rt)
    claims = cache_claims(cluster)
    assert set(claims) == {names.cache_claim_name(acme), names.cache_claim_name(globex)}
    claim = claims[names.cache_claim_name(acme)]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claim["spec"]["storageClassName"] == "shared-nfs"
    assert claim["spec"]["resources"]["requests"]["storage"] == "5Gi"
    assert "ownerReferences" not in claim["metadata"], "the cache belongs to no sandbox"
    assert sorted(i.sandbox_id for i in await rt.list()) == sorted([a1, a2, g1, plain])

    await rt.run(a1, ["sh", "-c", "echo from-acme > /.sbx/cache/marker"])
    assert await cache_file(rt, a2) == "from-acme"
    assert await cache_file(rt, g1) == "none"
    assert await cache_file(rt, plain) == "none"
    _, env, _ = await rt.run(a2, ["sh", "-c", 'echo "$PIP_CACHE_DIR $npm_config_cache"'])
    assert env.decode().split() == ["/.sbx/cache/pip", "/.sbx/cache/npm"]

    assert await rt.attach_cache(a1, acme) is False  # shown since the pod was made
    with pytest.raises(errors.Conflict):
        await rt.attach_cache(g1, acme)
    with pytest.raises(errors.NotBuiltYet, match="mounted when its pod is created"):
        await rt.attach_cache(plain, acme)

    for sid in (a1, a2, g1, plain):
        await rt.delete(sid)
    assert set(cache_claims(cluster)) == {names.cache_claim_name(acme), names.cache_claim_name(globex)}


async def test_without_a_cache_storage_class_there_are_no_caches(cluster, make_kube):
    rt = make_kube()
    assert rt.tenant_caches is False
    with pytest.raises(errors.ConfigError, match="SBX_K8S_CACHE_STORAGE_CLASS"):
        await rt.create(api.SandboxSpec(sandbox_id=new_id(), cache=ids.token("acme")))
    assert cache_claims(cluster) == {}


async def test_a_cache_deleted_by_an_operator_is_made_again_on_the_next_start(cluster, make_kube):
    """Deleting an organisation's cache claim is how an operator empties it; a stopped
    sandbox of that organisation then starts with a new one, not as a pod Pending forever
    on a claim that is gone. (That the new volume is empty is the storage's doing; the
    emulated kubelet keeps a node directory per claim name.)"""
    rt = make_kube(CACHED)
    key = ids.token("acme")
    sid = await started(rt, cache=key)
    await rt.run(sid, ["sh", "-c", "echo old > /.sbx/cache/marker"])
    await rt.stop(sid)
    core = await rt.cluster.core()
    await core.delete_namespaced_persistent_volume_claim(names.cache_claim_name(key), SETTINGS.namespace)
    await support.eventually(lambda: not cache_claims(cluster), timeout=10)
    await rt.start(sid)
    assert names.cache_claim_name(key) in cache_claims(cluster)
    result, _, _ = await rt.run(sid, ["sh", "-c", "touch /.sbx/cache/again"])
    assert result.exit_code == 0
    await rt.delete(sid)


async def test_turning_caches_off_leaves_stopped_sandboxes_able_to_start(cluster, make_kube):
    """A sandbox made with a cache still starts once caches are turned off (its claim is
    still there); if the claim is gone too, the start says NotFound, so the scheduler
    gives the session a new sandbox instead of failing every call."""
    key = ids.token("acme")
    sid = await started(make_kube(CACHED), cache=key)
    off = make_kube()
    await off.stop(sid)
    await off.start(sid)
    assert (await off.get(sid)).status == "running"
    await off.stop(sid)
    core = await off.cluster.core()
    await core.delete_namespaced_persistent_volume_claim(names.cache_claim_name(key), SETTINGS.namespace)
    await support.eventually(lambda: not cache_claims(cluster), timeout=10)
    with pytest.raises(errors.NotFound, match="SBX_K8S_CACHE_STORAGE_CLASS"):
        await off.start(sid)
    await off.delete(sid)
