"""The Kubernetes runtime's pure parts: the hardened pod spec field by field, the
per-sandbox NetworkPolicy, names and labels, settings, and the exec wrapper."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from sbx_api import errors
from shared.infrastructure.settings.kubernetes import KubernetesSettings
from shared.runtime import api
from shared.runtime.kubernetes import channel, manifests, names

SETTINGS = KubernetesSettings(images=(("default", "registry.example/sandbox:1"),))


def claim(spec: api.SandboxSpec) -> dict:
    made = manifests.workspace_claim(spec, SETTINGS)
    made["metadata"]["uid"] = "0b8a-uid"
    return made


def pod_of(spec: api.SandboxSpec, proxy: str | None = "http://10.96.0.20:3128") -> dict:
    return manifests.pod(spec, claim(spec), SETTINGS, image="registry.example/sandbox:1", proxy_url=proxy)


ROOT = api.SandboxSpec(sandbox_id="s-1", labels={"session": "abc", "pool": "default"})
USER = api.SandboxSpec(sandbox_id="s-2", run_as_root=False, writable_root=False)


def test_the_pod_is_hardened_field_by_field():
    pod = pod_of(ROOT)
    spec = pod["spec"]
    assert spec["automountServiceAccountToken"] is False
    assert spec["enableServiceLinks"] is False
    assert (spec["hostNetwork"], spec["hostPID"], spec["hostIPC"], spec["shareProcessNamespace"]) == (
        False,
    ) * 4
    assert spec["runtimeClassName"] == "gvisor"
    assert spec["restartPolicy"] == "Never"
    assert spec["dnsPolicy"] == "None" and spec["dnsConfig"] == {"nameservers": ["127.0.0.1"]}
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert all("hostPath" not in v for v in spec["volumes"]), "no host paths"
    assert {v["name"] for v in spec["volumes"]} == {"workspace", "tmp", "trust", "proxy-ca"}
    (container,) = spec["containers"]
    sc = container["securityContext"]
    assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"], "add": sorted(manifests.ROOT_CAPABILITIES)}
    assert not {"NET_RAW", "SYS_ADMIN", "MKNOD", "SYS_CHROOT", "SETPCAP", "NET_ADMIN"} & set(
        sc["capabilities"]["add"]
    )
    assert (sc["runAsUser"], sc["runAsNonRoot"], sc["readOnlyRootFilesystem"]) == (0, False, False)
    assert sc["procMount"] == "Default"
    assert container["resources"]["limits"] == {
        "cpu": "1000m",
        "memory": "2048Mi",
        "ephemeral-storage": "10Gi",
    }
    assert container["resources"]["requests"] == {
        "cpu": "100m",
        "memory": "256Mi",
        "ephemeral-storage": "100Mi",
    }
    assert spec["serviceAccountName"] == "sbx-sandbox"
    assert "ports" not in container and container["stdin"] is False and container["tty"] is False
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts["/workspace"]["subPath"] == "workspace" and mounts["/.sbx"]["subPath"] == "control"
    assert mounts[manifests.CA_DIR]["readOnly"] is True


def test_a_user_sandbox_keeps_no_capability_and_a_read_only_root():
    sc = pod_of(USER)["spec"]["containers"][0]["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"], "add": []}
    assert (sc["runAsUser"], sc["runAsGroup"], sc["runAsNonRoot"]) == (1000, 1000, True)
    assert sc["readOnlyRootFilesystem"] is True


def test_strong_isolation_uses_the_kata_class_and_an_empty_class_means_the_node_default():
    strong = api.SandboxSpec(sandbox_id="s-3", isolation="strong")
    assert pod_of(strong)["spec"]["runtimeClassName"] == "kata"
    plain = KubernetesSettings(runtime_class="", images=SETTINGS.images)
    body = manifests.pod(ROOT, claim(ROOT), plain, image="x", proxy_url=None)
    assert "runtimeClassName" not in body["spec"]


def test_a_localhost_seccomp_profile_is_used_when_configured():
    custom = KubernetesSettings(seccomp_profile="localhost/sbx/sbx-sandbox.json", images=SETTINGS.images)
    body = manifests.pod(ROOT, claim(ROOT), custom, image="x", proxy_url=None)
    expected = {"type": "Localhost", "localhostProfile": "sbx/sbx-sandbox.json"}
    assert body["spec"]["securityContext"]["seccompProfile"] == expected
    assert body["spec"]["containers"][0]["securityContext"]["seccompProfile"] == expected


def test_proxy_egress_sets_the_proxy_and_trust_variables_and_none_sets_none():
    env = {e["name"]: e["value"] for e in pod_of(ROOT)["spec"]["containers"][0]["env"]}
    assert env["HTTPS_PROXY"] == env["http_proxy"] == "http://10.96.0.20:3128"
    assert env["SSL_CERT_FILE"] == env["GIT_SSL_CAINFO"] == env["REQUESTS_CA_BUNDLE"] == manifests.BUNDLE
    assert env["NODE_EXTRA_CA_CERTS"] == f"{manifests.CA_DIR}/proxy-ca.pem"
    assert env["GIT_TERMINAL_PROMPT"] == "0"
    bare = pod_of(ROOT, proxy=None)
    env = {e["name"] for e in bare["spec"]["containers"][0]["env"]}
    assert not {"HTTP_PROXY", "HTTPS_PROXY", "SSL_CERT_FILE"} & env
    assert "proxy-ca" not in {v["name"] for v in bare["spec"]["volumes"]}


def test_the_network_policy_allows_only_the_proxies_or_nothing():
    policy = manifests.network_policy(ROOT, claim(ROOT), SETTINGS, egress="proxy")
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"] and policy["spec"]["ingress"] == []
    (rule,) = policy["spec"]["egress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 3128}]
    (peer,) = rule["to"]
    assert peer["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "sbx-proxy"}}
    assert peer["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "sbx-system"}}
    assert "ipBlock" not in peer
    assert policy["spec"]["podSelector"] == {
        "matchLabels": {names.SANDBOX: names.labels("s-1", {})[names.SANDBOX]}
    }
    closed = manifests.network_policy(ROOT, claim(ROOT), SETTINGS, egress="none")
    assert closed["spec"]["egress"] == [] and closed["spec"]["policyTypes"] == ["Ingress", "Egress"]


def test_pod_and_policy_are_owned_by_the_claim_which_records_the_spec():
    c = claim(ROOT)
    assert json.loads(c["metadata"]["annotations"][names.SPEC])["sandbox_id"] == "s-1"
    assert c["spec"]["resources"]["requests"]["storage"] == "10Gi"
    for owned in (pod_of(ROOT), manifests.network_policy(ROOT, c, SETTINGS, egress="none")):
        assert owned["metadata"]["ownerReferences"] == [
            {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "name": c["metadata"]["name"],
                "uid": "0b8a-uid",
            }
        ]


@pytest.mark.parametrize("sandbox_id", ["s-1", "A_B", "x" * 128, "UPPER-and_lower-0123456789"])
def test_names_are_valid_dns_labels_whatever_the_id(sandbox_id):
    import re

    for name in (names.object_name(sandbox_id), names.claim_name(sandbox_id)):
        assert len(name) <= 63 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name)
    assert names.object_name("a") != names.object_name("b")


def test_caller_labels_become_valid_label_values_and_selectors_match_them():
    weird = {"session": "has spaces/and:colons" + "x" * 80, "pool": "default"}
    labels = names.labels("s-1", weird)
    assert labels["label.sbx.dev/pool"] == "default"
    assert labels["label.sbx.dev/session"].startswith("v-") and len(labels["label.sbx.dev/session"]) <= 63
    selector = names.selector(weird)
    for term in selector.split(","):
        key, value = term.split("=")
        assert labels[key] == value


def test_a_sandbox_of_an_organisation_mounts_its_cache_claim_and_points_tools_at_it():
    key = "0" * 31 + "a"
    pod = pod_of(api.SandboxSpec(sandbox_id="s-3", cache=key))
    container = pod["spec"]["containers"][0]
    assert {"name": "cache", "mountPath": "/.sbx/cache"} in container["volumeMounts"]
    assert {"name": "cache", "persistentVolumeClaim": {"claimName": f"sbx-cache-{key}"}} in pod["spec"][
        "volumes"
    ]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["PIP_CACHE_DIR"] == "/.sbx/cache/pip" and env["XDG_CACHE_HOME"] == "/.sbx/cache"
    plain = pod_of(ROOT)
    assert all("cache" not in v["name"] for v in plain["spec"]["volumes"])
    assert "PIP_CACHE_DIR" not in {e["name"] for e in plain["spec"]["containers"][0]["env"]}


def test_a_cache_claim_is_read_write_many_of_the_cache_class_and_not_a_sandbox():
    cached = KubernetesSettings(cache_storage_class="nfs", cache_size="7Gi")
    key = "f" * 32
    made = manifests.cache_claim(key, cached)
    assert made["spec"] == {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": "7Gi"}},
        "storageClassName": "nfs",
    }
    assert made["metadata"]["labels"][names.COMPONENT] == "cache"
    assert f"{names.COMPONENT}=sandbox" in names.selector()  # what list() and the sweep select
    for bad in ("", "acme", "F" * 32, "f" * 33, "../x"):
        with pytest.raises(ValueError):
            manifests.cache_claim(bad, cached)


def test_settings_parse_and_refuse_clearly():
    parsed = KubernetesSettings.from_env(
        {"SBX_K8S_IMAGES": "default=reg.example/sb:2,python=python:3.12", "SBX_K8S_RUNTIME_CLASS": ""}
    )
    assert parsed.image("python") == "python:3.12" and parsed.runtime_class == ""
    assert parsed.snapshot_class == ""  # no snapshots unless named
    assert (
        KubernetesSettings.from_env({"SBX_K8S_SNAPSHOT_CLASS": "csi-snapclass"}).snapshot_class
        == "csi-snapclass"
    )
    for bad in (
        {"SBX_K8S_IMAGES": "python=python:3.12"},
        {"SBX_K8S_IMAGES": "default"},
        {"SBX_K8S_NAMESPACE": "Not_A_Name"},
        {"SBX_K8S_PROXY_SERVICE": "just-a-name"},
        {"SBX_K8S_WORKSPACE_SIZE": "ten gigs"},
        {"SBX_K8S_SECCOMP": "unconfined"},
        {"SBX_K8S_CACHE_SIZE": "lots"},
        {"SBX_K8S_CACHE_STORAGE_CLASS": "Not A Class"},
        {"SBX_K8S_SNAPSHOT_CLASS": "Not A Class"},
    ):
        with pytest.raises(errors.ConfigError):
            KubernetesSettings.from_env(bad)


def _sh(argv: list[str], stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(argv, input=stdin, capture_output=True, check=False, timeout=10)


def test_the_wrapper_sets_cwd_and_env_and_keeps_the_exit_code(tmp_path):
    argv = channel.wrap(
        ["sh", "-c", 'printf "%s|%s|%s" "$PWD" "$GREETING" "$SBX_EXEC_ID"; exit 7'],
        exec_id="e1",
        cwd=str(tmp_path),
        env={"GREETING": "hi; rm -rf / $(x)"},
        stdin_bytes=None,
    )
    done = _sh(argv)
    assert done.returncode == 7
    assert done.stdout.decode() == f"{tmp_path}|hi; rm -rf / $(x)|e1"


def test_the_wrapper_feeds_exactly_the_given_stdin(tmp_path):
    data = b"\x00\xffbinary\n"
    argv = channel.wrap(["cat"], exec_id="e2", cwd=str(tmp_path), env={}, stdin_bytes=len(data))
    done = _sh(argv, stdin=data + b"more that belongs to nobody")
    assert done.returncode == 0 and done.stdout == data
    assert not list(tmp_path.glob(".sbx-in-*"))


def test_the_wrapper_refuses_bad_input():
    with pytest.raises(errors.InvalidInput):
        channel.wrap(["true"], exec_id="e", cwd="/", env={"BAD NAME": "x"}, stdin_bytes=None)
    with pytest.raises(errors.InvalidInput):
        channel.wrap([], exec_id="e", cwd="/", env={}, stdin_bytes=None)


def test_exit_status_frames_are_read_as_kubernetes_writes_them():
    assert channel.exit_code({"metadata": {}, "status": "Success"}) == 0
    failure = {
        "status": "Failure",
        "reason": "NonZeroExitCode",
        "details": {"causes": [{"reason": "ExitCode", "message": "137"}]},
    }
    assert channel.exit_code(failure) == 137
    with pytest.raises(errors.InfrastructureError, match="container not found"):
        channel.exit_code({"status": "Failure", "message": "container not found", "reason": "InternalError"})


def test_caller_variables_cannot_change_what_the_wrapper_does(tmp_path):
    """The wrapper keeps no shell variable of its own: ``n``, ``x``, ``f`` from the caller
    are just variables of the command."""
    env = {"A": "1", "n": "0", "x": "evil", "f": "/etc/passwd", "B": "2"}
    argv = channel.wrap(
        ["sh", "-c", 'printf "%s" "$A$n$x$B"'], exec_id="e3", cwd=str(tmp_path), env=env, stdin_bytes=4
    )
    done = _sh(argv, stdin=b"data")
    assert (done.returncode, done.stdout) == (0, b"10evil2")
    with pytest.raises(errors.InvalidInput):
        channel.wrap(["true"], exec_id="e", cwd="/", env={"SBX_EXEC_ID": "other"}, stdin_bytes=None)


@pytest.mark.skipif(not __import__("shutil").which("setpriv"), reason="setpriv (util-linux) missing")
@pytest.mark.needs_root("runs processes as another user")
def test_the_killer_kills_even_when_other_processes_environments_are_unreadable():
    """As an unprivileged user (as in a pod with every capability dropped), grep cannot read
    root's /proc/*/environ and exits 2; the killer must go on and kill its target."""
    as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    target = subprocess.Popen([*as_nobody, "env", "SBX_EXEC_ID=k1", "sleep", "300"])
    try:
        # The id is in the target's environ only once env has exec'd sleep (setpriv and env
        # come first, with it only on their command line): a killer run before that finds
        # nothing, rightly. CI's loaded machine met that moment.
        environ = f"/proc/{target.pid}/environ"
        deadline = time.monotonic() + 10
        while b"SBX_EXEC_ID=k1" not in open(environ, "rb").read():
            assert time.monotonic() < deadline, "the target never started"
            time.sleep(0.01)
        done = _sh([*as_nobody, *channel.killer("k1")])
        assert done.returncode == 0, done.stderr
        assert target.wait(10) == -9
    finally:
        target.kill()


def test_a_snapshots_manifest_and_a_forks_claim():
    from shared.runtime.kubernetes import snapshots

    settings = KubernetesSettings(snapshot_class="csi-snapclass")
    spec = api.SandboxSpec(sandbox_id="task-42", image="python:3.12", run_as_root=False)
    made = snapshots.manifest("snap-1", spec, settings)
    assert made["kind"] == "VolumeSnapshot" and made["spec"] == {
        "volumeSnapshotClassName": "csi-snapclass",
        "source": {"persistentVolumeClaimName": names.claim_name("task-42")},
    }
    assert made["metadata"]["labels"][names.COMPONENT] == "snapshot"  # never listed as a sandbox
    meta = {**made["metadata"], "uid": "u-1", "creationTimestamp": "2026-12-04T02:00:00Z"}
    status = {"readyToUse": True, "restoreSize": "2Gi", "boundVolumeSnapshotContentName": "c-1"}
    ready = {**made, "metadata": meta, "status": status}
    info = snapshots.info(ready)
    assert (info.snapshot_id, info.sandbox_id, info.image, info.run_as_root) == (
        "snap-1",
        "task-42",
        "python:3.12",
        False,
    )
    assert info.size == 2 * 1024**3 and info.layers == (names.snapshot_name("snap-1"),)
    assert snapshots.quantity_bytes("1500M") == 1_500_000_000 and snapshots.quantity_bytes("junk") == 0
    fork = manifests.workspace_claim(api.SandboxSpec(sandbox_id="fork-1", snapshot="snap-1"), settings)
    assert fork["spec"]["dataSource"] == {
        "apiGroup": "snapshot.storage.k8s.io",
        "kind": "VolumeSnapshot",
        "name": names.snapshot_name("snap-1"),
    }
    assert (
        "dataSource" not in manifests.workspace_claim(api.SandboxSpec(sandbox_id="plain"), settings)["spec"]
    )
