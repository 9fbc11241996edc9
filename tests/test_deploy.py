"""deploy/ checked offline: every Kubernetes manifest against the API schemas, the
kustomizations' file references, the security settings of every workload, the sandbox
seccomp profile, the names the Kubernetes runtime relies on, the Dockerfiles and compose.

A live cluster is not needed (that is tests/kubernetes/test_live_cluster.py); when
``kubectl`` or ``kustomize`` is on the PATH, the rendered kustomizations are validated too.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from services.gateway import origins
from shared.infrastructure.settings import bus, kubernetes, lifecycle, proxies, runtime
from shared.infrastructure.settings import gateway as gateway_settings
from shared.infrastructure.settings import service as service_settings
from shared.runtime.kubernetes import manifests, names

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
KUBE = DEPLOY / "kubernetes"
BASE = KUBE / "base"
KUBERNETES_VERSION = "1.33"
"""Schemas of this release (kubernetes-validate ships 1.25 and later)."""
NOT_OBJECTS = {"kustomization.yaml", "kind-config.yaml"}
PROFILE = BASE / "seccomp" / "sbx-sandbox.json"
INSTALLER = ("DaemonSet", "seccomp-installer")
"""The one workload that runs as root with a hostPath (seccomp-installer.yaml says why)."""
API_CALLERS = {"pool-manager", "executor", "reaper", "proxy-scaler"}
SERVICES = {
    "gateway": "gateway",
    "scheduler": "scheduler",
    "pool-manager": "pool_manager",
    "executor": "executor",
    "reaper": "reaper",
    "proxy-scaler": "proxy_scaler",
}
FORBIDDEN_SYSCALLS = """
keyctl add_key request_key bpf perf_event_open userfaultfd unshare setns mount umount2 pivot_root
ptrace process_vm_readv process_vm_writev kexec_load kexec_file_load init_module finit_module
delete_module open_by_handle_at name_to_handle_at iopl ioperm swapon swapoff reboot acct
settimeofday clock_settime adjtimex syslog lookup_dcookie quotactl nfsservctl vm86 vm86old
move_pages mbind get_mempolicy set_mempolicy
""".split()
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet"}


def manifest_files() -> list[Path]:
    return sorted(p for p in KUBE.rglob("*.yaml") if p.name not in NOT_OBJECTS)


def load(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def objects() -> list[dict[str, Any]]:
    return [doc for path in manifest_files() for doc in load(path)]


def find(kind: str, name: str, namespace: str | None = None) -> dict[str, Any]:
    for doc in objects():
        meta = doc["metadata"]
        if doc["kind"] == kind and meta["name"] == name and meta.get("namespace") == namespace:
            return doc
    raise AssertionError(f"no {kind} {namespace}/{name} under {KUBE}")


def workloads() -> list[dict[str, Any]]:
    return [doc for doc in objects() if doc["kind"] in WORKLOADS]


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def containers(workload: dict[str, Any]) -> list[dict[str, Any]]:
    spec = pod_spec(workload)
    return spec.get("initContainers", []) + spec["containers"]


def ident(workload: dict[str, Any]) -> tuple[str, str]:
    return workload["kind"], workload["metadata"]["name"]


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels and the In/NotIn/Exists/DoesNotExist expressions)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        if (
            (op == "In" and labels.get(key) not in values)
            or (op == "NotIn" and labels.get(key) in values)
            or (op == "Exists" and key not in labels)
            or (op == "DoesNotExist" and key in labels)
        ):
            return False
    return True


def pods_in(namespace: str) -> list[dict[str, str]]:
    return [
        w["spec"]["template"]["metadata"]["labels"]
        for w in workloads()
        if w["metadata"]["namespace"] == namespace
    ]


# ---- (1) schemas ----------------------------------------------------------------------------


def test_there_are_manifests_to_check():
    kinds = {doc["kind"] for doc in objects()}
    expected = {"Namespace", "StatefulSet", "Deployment", "DaemonSet", "Service", "ServiceAccount", "Role"}
    expected |= {
        "RoleBinding",
        "NetworkPolicy",
        "RuntimeClass",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
    }
    assert expected <= kinds, f"missing kinds: {sorted(expected - kinds)}"


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(KUBE)))
def test_every_manifest_is_valid_against_the_kubernetes_schema(path: Path):
    docs = load(path)
    assert docs, f"{path} holds no objects"
    for doc in docs:
        name = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{path.name}: {name}: {where}: {exc.message}")


def test_the_validator_rejects_a_broken_object():
    """The schema check above is real: an unknown field and a wrong type both fail."""
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"}, "spec": {"ports": []}}
    kubernetes_validate.validate(service, KUBERNETES_VERSION, strict=True)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dict(service, spek={}), KUBERNETES_VERSION, strict=True)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(
            dict(service, spec={"ports": [{"port": "http"}]}), KUBERNETES_VERSION, strict=True
        )


def test_namespaced_objects_name_their_namespace():
    """The base has no global `namespace:` (objects live in three namespaces)."""
    cluster_scoped = {"Namespace", "RuntimeClass"}
    declared = {doc["metadata"]["name"] for doc in objects() if doc["kind"] == "Namespace"}
    for doc in objects():
        namespace = doc["metadata"].get("namespace")
        if doc["kind"] in cluster_scoped:
            assert namespace is None, doc["metadata"]["name"]
        else:
            assert namespace in declared, f"{doc['kind']}/{doc['metadata']['name']}: namespace {namespace!r}"


KUSTOMIZE = shutil.which("kustomize")
KUBECTL = shutil.which("kubectl")


def kustomize_build(directory: Path) -> list[dict[str, Any]]:
    command = [KUSTOMIZE, "build", str(directory)] if KUSTOMIZE else [KUBECTL, "kustomize", str(directory)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.mark.skipif(not (KUSTOMIZE or KUBECTL), reason="neither kustomize nor kubectl is installed")
@pytest.mark.parametrize("directory", [BASE, KUBE / "overlays" / "kind"], ids=["base", "kind"])
def test_the_rendered_kustomization_is_valid(directory: Path):
    docs = kustomize_build(directory)
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    (settings_map,) = [
        d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("sbx-settings-")
    ]
    for doc in docs:
        if doc["kind"] == "Deployment" and doc["metadata"]["name"] in SERVICES:
            (container,) = pod_spec(doc)["containers"]
            assert container["envFrom"] == [{"configMapRef": {"name": settings_map["metadata"]["name"]}}]
    env = settings_map["data"]
    kube = kubernetes.KubernetesSettings.from_env(env)
    if directory.name == "kind":
        assert all(ref.endswith(":dev") for _, ref in kube.images)
        assert kube.strong_runtime_class == ""
        images = {c["image"] for d in docs if d["kind"] == "Deployment" for c in containers(d)}
        assert all(i.endswith(":dev") for i in images if "cloud-agent-sandbox" in i), images
        assert all(d["spec"]["replicas"] == 1 for d in docs if d["kind"] == "Deployment")
        (nats,) = [d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "nats"]
        assert nats["spec"]["replicas"] == 1 and "--routes" not in pod_spec(nats)["containers"][0]["args"]
        assert env["SBX_NATS_REPLICAS"] == "1", "one server: one copy"


# ---- (2) kustomizations -----------------------------------------------------------------------


def kustomizations() -> list[Path]:
    return sorted(KUBE.rglob("kustomization.yaml"))


def test_every_kustomization_references_files_that_exist():
    found = kustomizations()
    assert {p.parent for p in found} >= {BASE, KUBE / "overlays" / "kind"}
    for path in found:
        k = yaml.safe_load(path.read_text())
        here = path.parent
        for resource in k.get("resources", []):
            target = here / resource
            assert target.exists(), f"{path}: resource {resource} does not exist"
            if target.is_dir():
                assert (target / "kustomization.yaml").is_file(), f"{path}: {resource} is no kustomization"
        for patch in k.get("patches", []):
            assert "path" in patch or "patch" in patch, f"{path}: a patch with neither path nor patch"
            if "path" in patch:
                assert (here / patch["path"]).is_file(), f"{path}: patch {patch['path']} does not exist"
        for generator in k.get("configMapGenerator", []) + k.get("secretGenerator", []):
            for entry in generator.get("files", []) + generator.get("envs", []):
                file = entry.split("=", 1)[-1]
                assert (here / file).is_file(), f"{path}: generator file {file} does not exist"
                assert (here / file).resolve().is_relative_to(here.resolve()), (
                    f"{path}: {file} is outside the kustomization root (kustomize refuses it)"
                )


def test_the_base_lists_every_manifest_file():
    k = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    on_disk = {p.name for p in BASE.glob("*.yaml") if p.name != "kustomization.yaml"}
    assert set(k["resources"]) == on_disk


def test_the_shared_settings_are_accepted_by_the_services():
    env = dict(
        line.split("=", 1)
        for line in (BASE / "settings.env").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    )
    assert env["SBX_RUNTIME"] == "kubernetes" and env["SBX_SANDBOX_EGRESS"] == "proxy"
    assert env["NATS_URL"] == "nats://nats.sbx-system.svc:4222"
    service_settings.ServiceSettings.from_env("test", env)
    runtime.RuntimeSettings.from_env(env)
    lifecycle.LifecycleSettings.from_env(env)
    proxies.ProxySettings.from_env(env)
    kube = kubernetes.KubernetesSettings.from_env(env)
    assert kube.namespace == "sbx-sandboxes" and kube.proxy_service == "sbx-system/sbx-proxy"
    assert "SANDBOX_API_KEY" not in env, "the key comes from a Secret, for the gateway only"
    # The gateway answers to its Service's names, pod addresses (probes) and port-forwards.
    gateway = gateway_settings.GatewaySettings.from_env({**env, "SANDBOX_API_KEY": "k" * 32})
    allowed = origins.Allowed.build("0.0.0.0", gateway.allowed_hosts)
    for host in ("gateway.sbx-system.svc:8080", "gateway:8080", "10.244.0.7:8080", "127.0.0.1:8080"):
        assert allowed.refusal([host], []) is None, host
    assert allowed.refusal(["evil.example:8080"], []) is not None


# ---- (3) seccomp ------------------------------------------------------------------------------


def allowed_syscalls(profile: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Every syscall an ALLOW rule names, with the argument conditions of each rule."""
    out: dict[str, list[dict[str, Any]]] = {}
    for rule in profile["syscalls"]:
        if rule["action"] in ("SCMP_ACT_ALLOW", "SCMP_ACT_LOG"):
            for name in rule["names"]:
                out.setdefault(name, []).append(rule)
    return out


def test_the_seccomp_profile_refuses_by_default_and_allows_no_forbidden_call():
    profile = json.loads(PROFILE.read_text())
    assert profile["defaultAction"] == "SCMP_ACT_ERRNO"
    assert {"SCMP_ARCH_X86_64", "SCMP_ARCH_AARCH64"} <= set(profile["architectures"])
    allowed = allowed_syscalls(profile)
    assert not set(FORBIDDEN_SYSCALLS) & set(allowed), sorted(set(FORBIDDEN_SYSCALLS) & set(allowed))
    assert not any(name.startswith("kexec_") for name in allowed)
    # A usable profile: what every build and shell needs is there.
    for needed in ("read", "write", "openat", "execve", "mmap", "futex", "wait4", "pipe2", "connect"):
        assert needed in allowed, needed


def test_the_seccomp_profile_allows_clone_only_without_namespace_flags():
    allowed = allowed_syscalls(json.loads(PROFILE.read_text()))
    new_namespaces = 0x7E020000  # CLONE_NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET
    assert allowed["clone"], "threads and fork need clone"
    for rule in allowed["clone"]:
        (arg,) = rule["args"]
        assert arg["op"] == "SCMP_CMP_MASKED_EQ" and arg["value"] & new_namespaces == new_namespaces
        assert arg["valueTwo"] == 0
    assert "clone3" not in allowed, "clone3's flags cannot be checked: it must fail (ENOSYS)"
    for rule in allowed.get("socket", []):
        assert {"index": 0, "value": 40, "op": "SCMP_CMP_NE"} in rule.get("args", []), "no AF_VSOCK"


def test_the_seccomp_profile_is_installed_where_the_runtime_setting_points():
    k = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    generated = {g["name"]: g for g in k["configMapGenerator"]}
    assert generated["sbx-seccomp-profiles"]["files"] == ["seccomp/sbx-sandbox.json"]
    installer = find(*INSTALLER, "sbx-node-setup")
    volumes = {v["name"]: v for v in pod_spec(installer)["volumes"]}
    assert volumes["profiles"]["configMap"]["name"] == "sbx-seccomp-profiles"
    assert volumes["kubelet-seccomp"]["hostPath"]["path"] == "/var/lib/kubelet/seccomp"
    script = "\n".join(pod_spec(installer)["containers"][0]["command"])
    assert "/host/seccomp/sbx" in script
    value = "localhost/sbx/sbx-sandbox.json"
    kube = kubernetes.KubernetesSettings.from_env({"SBX_K8S_SECCOMP": value})
    assert kube.seccomp_profile == value
    assert (DEPLOY / "seccomp" / "README.md").read_text().count("kubernetes/base/seccomp/sbx-sandbox.json")


# ---- (4) workloads ----------------------------------------------------------------------------


@pytest.mark.parametrize("workload", workloads(), ids=lambda w: "/".join(ident(w)))
def test_every_container_is_limited_and_locked_down(workload: dict[str, Any]):
    spec = pod_spec(workload)
    pod_security = spec.get("securityContext", {})
    assert pod_security.get("seccompProfile", {}).get("type") == "RuntimeDefault"
    assert spec.get("hostNetwork") is not True and spec.get("hostPID") is not True
    assert spec.get("hostIPC") is not True
    for container in containers(workload):
        where = f"{'/'.join(ident(workload))} container {container['name']}"
        limits = container.get("resources", {}).get("limits", {})
        assert {"cpu", "memory"} <= set(limits), f"{where}: no cpu and memory limits"
        assert container["resources"].get("requests"), f"{where}: no requests"
        security = container.get("securityContext", {})
        assert security.get("allowPrivilegeEscalation") is False, where
        assert "ALL" in security.get("capabilities", {}).get("drop", []), where
        assert not security.get("capabilities", {}).get("add"), f"{where}: adds capabilities"
        assert security.get("privileged") is not True, where
        assert security.get("readOnlyRootFilesystem") is True, where
        non_root = security.get("runAsNonRoot", pod_security.get("runAsNonRoot"))
        if ident(workload) == INSTALLER:
            assert security.get("runAsUser") == 0  # the documented exception
        else:
            assert non_root is True, f"{where}: may run as root"
            assert security.get("runAsUser", pod_security.get("runAsUser", 0)) > 0, where
    host_paths = [v for v in spec.get("volumes", []) if "hostPath" in v]
    assert not host_paths or ident(workload) == INSTALLER, f"{'/'.join(ident(workload))} mounts the host"


@pytest.mark.parametrize(
    "workload", [w for w in workloads() if w["kind"] != "DaemonSet"], ids=lambda w: "/".join(ident(w))
)
def test_every_long_running_container_has_liveness_and_readiness_probes(workload: dict[str, Any]):
    for container in pod_spec(workload)["containers"]:
        assert "livenessProbe" in container, container["name"]
        assert "readinessProbe" in container, container["name"]


def test_the_installer_is_alone_in_the_privileged_namespace():
    levels = {
        doc["metadata"]["name"]: doc["metadata"]["labels"]["pod-security.kubernetes.io/enforce"]
        for doc in objects()
        if doc["kind"] == "Namespace"
    }
    assert levels == {"sbx-system": "restricted", "sbx-sandboxes": "baseline", "sbx-node-setup": "privileged"}
    sandboxes = find("Namespace", "sbx-sandboxes")["metadata"]["labels"]
    assert sandboxes["pod-security.kubernetes.io/warn"] == "restricted"
    privileged = [ident(w) for w in workloads() if w["metadata"]["namespace"] == "sbx-node-setup"]
    assert privileged == [INSTALLER]
    assert not pod_spec(find(*INSTALLER, "sbx-node-setup")).get("automountServiceAccountToken", True)


def test_the_services_run_their_own_module_from_the_one_image():
    for name, module in SERVICES.items():
        deployment = find("Deployment", name, "sbx-system")
        (container,) = pod_spec(deployment)["containers"]
        assert container["command"] == ["python", "-m", f"services.{module}"]
        assert (ROOT / "services" / module / "__main__.py").is_file()
        assert container["image"] == "ghcr.io/cloud-agent-sandbox/services:0.1.0"
        env = {e["name"]: e for e in container.get("env", [])}
        assert container["envFrom"] == [{"configMapRef": {"name": "sbx-settings"}}]
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert "/tmp" in mounts
        if name == "gateway":
            assert env["SANDBOX_API_KEY"]["valueFrom"]["secretKeyRef"] == {
                "name": "sbx-api-key",
                "key": "key",
            }
            assert (
                env["SBX_GATEWAY_HOST"]["value"] == "0.0.0.0" and env["SBX_GATEWAY_PORT"]["value"] == "8080"
            )
            assert container["readinessProbe"]["httpGet"]["path"] == "/healthz"
        else:
            assert "SANDBOX_API_KEY" not in env, f"{name} must not get the API key"
            assert env["SBX_METRICS_PORT"]["value"] == "9090"


def test_only_the_services_that_call_kubernetes_get_a_token():
    for name in SERVICES:
        account = find("ServiceAccount", f"sbx-{name}", "sbx-system")
        spec = pod_spec(find("Deployment", name, "sbx-system"))
        assert spec["serviceAccountName"] == f"sbx-{name}"
        wanted = name in API_CALLERS
        assert account["automountServiceAccountToken"] is wanted, name
        assert spec["automountServiceAccountToken"] is wanted, name
    proxy = pod_spec(find("Deployment", "sbx-proxy", "sbx-system"))
    assert proxy["automountServiceAccountToken"] is False
    assert (
        find("ServiceAccount", proxy["serviceAccountName"], "sbx-system")["automountServiceAccountToken"]
        is False
    )
    nats = pod_spec(find("StatefulSet", "nats", "sbx-system"))
    assert nats["automountServiceAccountToken"] is False


def test_autoscalers_and_budgets_point_at_real_deployments():
    expected = {"gateway": (2, 10), "executor": (2, 20), "scheduler": (2, 6)}
    hpas = {d["metadata"]["name"]: d for d in objects() if d["kind"] == "HorizontalPodAutoscaler"}
    assert set(hpas) == set(expected), "pool-manager, reaper and proxy-scaler work under leases: no HPA"
    for name, (low, high) in expected.items():
        spec = hpas[name]["spec"]
        assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}
        target = find("Deployment", name, "sbx-system")
        assert "replicas" not in target["spec"], f"{name}: the HPA owns replicas (an apply would reset it)"
        assert (spec["minReplicas"], spec["maxReplicas"]) == (low, high)
        (metric,) = spec["metrics"]
        assert (
            metric["resource"]["name"] == "cpu" and metric["resource"]["target"]["averageUtilization"] == 70
        )
    budgets = {d["metadata"]["name"]: d for d in objects() if d["kind"] == "PodDisruptionBudget"}
    assert set(budgets) == {"gateway", "executor", "nats"}
    for name, budget in budgets.items():
        kind = "StatefulSet" if name == "nats" else "Deployment"
        labels = find(kind, name, "sbx-system")["spec"]["template"]["metadata"]["labels"]
        assert selects(budget["spec"]["selector"], labels)


def test_every_selector_selects_its_own_pods():
    for workload in workloads():
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert selects(workload["spec"]["selector"], labels), ident(workload)
    for service in (d for d in objects() if d["kind"] == "Service"):
        namespace = service["metadata"]["namespace"]
        selector = {"matchLabels": service["spec"]["selector"]}
        assert any(selects(selector, labels) for labels in pods_in(namespace)), service["metadata"]["name"]


def test_nats_is_a_persistent_jetstream_server():
    nats = find("StatefulSet", "nats", "sbx-system")
    (container,) = pod_spec(nats)["containers"]
    assert container["image"] == "nats:2.11-alpine"
    assert container["args"][:5] == ["-js", "-sd", "/data", "-m", "8222"]
    assert container["livenessProbe"]["httpGet"]["port"] in ("monitor", 8222)
    (claim,) = nats["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "10Gi"
    assert (
        pod_spec(nats)["securityContext"]["runAsUser"] == 1000
        and pod_spec(nats)["securityContext"]["fsGroup"]
    )
    client = find("Service", "nats", "sbx-system")
    assert [p["port"] for p in client["spec"]["ports"]] == [4222]
    assert find("Service", "nats-headless", "sbx-system")["spec"]["clusterIP"] == "None"


def test_nats_is_a_three_node_cluster_and_the_services_make_three_copies():
    """Base: three servers routed to each other by their stable pod names, every stream
    and bucket made with 3 copies, a disruption budget keeping the quorum."""
    nats = find("StatefulSet", "nats", "sbx-system")
    assert nats["spec"]["replicas"] == 3
    (container,) = pod_spec(nats)["containers"]
    args = container["args"]
    flag = {args[i]: args[i + 1] for i in range(5, len(args), 2)}
    assert flag["--server_name"] == "$(POD_NAME)"
    assert {e["name"]: e for e in container["env"]}["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.name"
    )
    routes = flag["--routes"].split(",")
    assert routes == [f"nats://nats-{n}.nats-headless:6222" for n in range(3)]
    assert flag["--cluster"].endswith(":6222")
    settings_env = (KUBE / "base" / "settings.env").read_text().splitlines()
    assert "SBX_NATS_REPLICAS=3" in settings_env
    assert (
        bus.BusSettings.from_env(dict(line.split("=", 1) for line in settings_env if "=" in line)).replicas
        == 3
    )
    budget = find("PodDisruptionBudget", "nats", "sbx-system")
    assert budget["spec"]["maxUnavailable"] == 1


# ---- what the Kubernetes runtime relies on --------------------------------------------------


def test_the_proxy_matches_what_sandbox_pods_and_their_policies_expect():
    kube = kubernetes.KubernetesSettings()
    namespace, name = kube.proxy_namespace, kube.proxy_name
    key, value = names.PROXY_POD_LABEL
    proxy = find("Deployment", name, namespace)
    assert proxy["spec"]["template"]["metadata"]["labels"][key] == value
    assert "replicas" not in proxy["spec"], "the proxy-scaler owns the count; an apply must not reset it"
    (container,) = pod_spec(proxy)["containers"]
    assert [p["containerPort"] for p in container["ports"]] == [kube.proxy_port]
    assert container["readinessProbe"]["tcpSocket"]["port"] in ("proxy", kube.proxy_port)
    script = " ".join(container["command"])
    for flag in (
        "--listen-host 0.0.0.0",
        f"--listen-port {kube.proxy_port}",
        "--confdir /var/lib/sbx-proxy/ca",
    ):
        assert flag in script
    assert "--config /etc/sbx-proxy/config.toml" in script
    volumes = {v["name"]: v for v in pod_spec(proxy)["volumes"]}
    assert volumes["ca-secret"]["secret"]["secretName"] == "sbx-proxy-ca"
    assert {i["key"] for i in volumes["ca-secret"]["secret"]["items"]} == {
        "mitmproxy-ca.pem",
        "mitmproxy-ca-cert.pem",
    }
    assert volumes["config"]["configMap"] == {"name": "sbx-proxy-config", "optional": True}
    service = find("Service", name, namespace)
    assert service["spec"]["type"] == "ClusterIP"  # the runtime reads its cluster IP
    assert [p["port"] for p in service["spec"]["ports"]] == [kube.proxy_port]
    assert selects(
        {"matchLabels": service["spec"]["selector"]}, proxy["spec"]["template"]["metadata"]["labels"]
    )
    # Sandboxes mount the CA certificate from this ConfigMap; the operator creates it.
    readme = (DEPLOY / "README.md").read_text()
    assert f"-n {kube.namespace} create configmap {manifests.CA_CONFIGMAP}" in readme
    assert "--from-file=proxy-ca.pem=" in readme and "--init-ca" in readme


def test_the_runtime_classes_the_settings_name_exist():
    kube = kubernetes.KubernetesSettings()
    classes = {d["metadata"]["name"]: d for d in objects() if d["kind"] == "RuntimeClass"}
    assert classes[kube.runtime_class]["handler"] == "runsc"
    assert classes[kube.strong_runtime_class]["handler"] == "kata"
    assert classes[kube.strong_runtime_class]["overhead"]["podFixed"]


def test_sandbox_pods_fit_the_sandbox_namespace_pod_security_level():
    """A run_as_root sandbox keeps only capabilities the `baseline` level allows."""
    baseline = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD"}
    baseline |= {"NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
    assert set(manifests.ROOT_CAPABILITIES) <= baseline
    assert kubernetes.KubernetesSettings().namespace == "sbx-sandboxes"


# ---- (5) network policies ---------------------------------------------------------------------


def policies(namespace: str) -> list[dict[str, Any]]:
    return [d for d in objects() if d["kind"] == "NetworkPolicy" and d["metadata"]["namespace"] == namespace]


@pytest.mark.parametrize("namespace", ["sbx-sandboxes", "sbx-system", "sbx-node-setup"])
def test_every_namespace_denies_all_traffic_by_default(namespace: str):
    deny = [
        p
        for p in policies(namespace)
        if p["spec"]["podSelector"] == {}
        and set(p["spec"]["policyTypes"]) == {"Ingress", "Egress"}
        and not p["spec"].get("ingress")
        and not p["spec"].get("egress")
    ]
    assert deny, f"no default-deny (Ingress and Egress) NetworkPolicy in {namespace}"


def test_nothing_in_deploy_opens_the_sandbox_namespace():
    """Sandboxes' only way out is the per-sandbox policy the runtime creates."""
    for policy in policies("sbx-sandboxes"):
        assert not policy["spec"].get("ingress") and not policy["spec"].get("egress"), policy["metadata"][
            "name"
        ]


def test_dns_is_for_the_system_namespace_only():
    for policy in (d for d in objects() if d["kind"] == "NetworkPolicy"):
        for rule in policy["spec"].get("egress", []):
            if any(p.get("port") == 53 for p in rule.get("ports", [])):
                assert policy["metadata"]["namespace"] == "sbx-system", policy["metadata"]["name"]


def test_the_proxy_takes_connections_from_sandboxes_only_and_reaches_only_public_web_ports():
    by_name = {p["metadata"]["name"]: p for p in policies("sbx-system")}
    (rule,) = by_name["proxy-ingress"]["spec"]["ingress"]
    (peer,) = rule["from"]
    assert peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "sbx-sandboxes"}
    sandbox_labels = names.labels("any-sandbox", {})
    assert selects(peer["podSelector"], sandbox_labels)
    assert [p["port"] for p in rule["ports"]] == [kubernetes.KubernetesSettings().proxy_port]
    (egress,) = by_name["proxy-egress"]["spec"]["egress"]
    assert sorted(p["port"] for p in egress["ports"]) == [80, 443]
    v4 = next(peer["ipBlock"] for peer in egress["to"] if peer["ipBlock"]["cidr"] == "0.0.0.0/0")
    for private in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "169.254.0.0/16", "127.0.0.0/8"):
        assert private in v4["except"], private
    proxy_labels = find("Deployment", "sbx-proxy", "sbx-system")["spec"]["template"]["metadata"]["labels"]
    for name in ("proxy-ingress", "proxy-egress"):
        assert selects(by_name[name]["spec"]["podSelector"], proxy_labels), name


def test_system_policies_select_the_pods_they_are_written_for():
    by_name = {p["metadata"]["name"]: p for p in policies("sbx-system")}
    labels_of = {w["metadata"]["name"]: w["spec"]["template"]["metadata"]["labels"] for w in workloads()}
    selected = {
        name: {w for w, labels in labels_of.items() if selects(p["spec"]["podSelector"], labels)}
        for name, p in by_name.items()
    }
    assert selected["services-to-nats"] == set(SERVICES)
    assert selected["services-to-apiserver"] == API_CALLERS
    assert selected["gateway-ingress"] == {"gateway"}
    assert selected["nats-clients"] == {"nats"}
    (rule,) = by_name["nats-clients"]["spec"]["ingress"]
    (peer,) = rule["from"]
    assert {w for w in SERVICES if selects(peer["podSelector"], labels_of[w])} == set(SERVICES)
    assert [p["port"] for p in rule["ports"]] == [4222]


# ---- (6) Dockerfiles --------------------------------------------------------------------------


def dockerfiles() -> list[Path]:
    return sorted((DEPLOY / "docker").glob("*.Dockerfile"))


def test_the_three_images_have_dockerfiles():
    assert {p.name for p in dockerfiles()} >= {
        "services.Dockerfile",
        "proxy.Dockerfile",
        "sandbox.Dockerfile",
    }


@pytest.mark.parametrize("path", dockerfiles(), ids=lambda p: p.name)
def test_every_image_but_the_sandbox_runs_as_a_non_root_user(path: Path):
    users = re.findall(r"^USER\s+(\S+)", path.read_text(), flags=re.MULTILINE)
    if path.name == "sandbox.Dockerfile":
        return  # the runtime sets the sandbox's user per pod (uid 0 for run_as_root)
    assert users, f"{path.name} has no USER"
    user = users[-1].split(":")[0]
    assert user not in ("0", "root"), f"{path.name} runs as root"
    assert not user.isdigit() or int(user) >= 1000


def test_the_image_users_match_the_manifests():
    text = {p.name: p.read_text() for p in dockerfiles()}
    assert "USER 10001" in text["services.Dockerfile"]
    assert "USER 10002" in text["proxy.Dockerfile"] and 'ENTRYPOINT ["sbx-proxy"]' in text["proxy.Dockerfile"]
    assert "pip install ./proxy" in text["proxy.Dockerfile"]
    assert pod_spec(find("Deployment", "gateway", "sbx-system"))["securityContext"]["runAsUser"] == 10001
    assert pod_spec(find("Deployment", "sbx-proxy", "sbx-system"))["securityContext"]["runAsUser"] == 10002
    sandbox = text["sandbox.Dockerfile"]
    assert sandbox.startswith("#") and "FROM debian:bookworm-slim" in sandbox
    assert f"--uid {manifests.SANDBOX_UID}" in sandbox and "--home-dir /workspace" in sandbox
    assert "WORKDIR /workspace" in sandbox and manifests.CA_DIR in sandbox and manifests.BUNDLE in sandbox


# ---- (7) compose ------------------------------------------------------------------------------


def test_compose_runs_the_proxy_from_its_image():
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    proxy = compose["services"]["proxy"]
    assert (ROOT / proxy["build"]["dockerfile"]).name == "proxy.Dockerfile"
    assert (ROOT / proxy["build"]["dockerfile"]).is_file()
    assert proxy["image"] == "cloud-agent-sandbox/proxy:dev"
    assert "3128" in " ".join(proxy["command"]) and any(p.endswith(":3128") for p in proxy["ports"])
    assert any(v.endswith(":/var/lib/sbx-proxy/ca") for v in proxy["volumes"])
    assert "SANDBOX_API_KEY" not in proxy.get("environment", {})
