"""What a sandbox's Kubernetes objects look like (pure: spec + settings in, dicts out).

Three objects per sandbox, all labelled with its token (``names.labels``):

* a **PersistentVolumeClaim**, created by ``create`` and kept until ``delete``: the
  workspace (``/workspace``) and the session's control files (``/.sbx``), so a stopped
  sandbox resumes with both. It carries the spec as an annotation: it is the record.
* a **Pod**, created by ``start`` and deleted by ``stop``; hardened as below.
* a **NetworkPolicy** selecting only that pod: no ingress; egress only to the credential
  proxies' pods on the proxy port (or nothing when egress is ``none``).

Pod and NetworkPolicy are owned by the claim, so deleting the claim garbage-collects
them even if the runtime dies half-way through ``delete``.
"""

from __future__ import annotations

import json
import math
from typing import Any

import msgspec

from shared.infrastructure.settings.kubernetes import KubernetesSettings
from shared.runtime import api
from shared.runtime.kubernetes import names, snapshots

SANDBOX_UID = 1000
"""The unprivileged user of ``run_as_root=False`` sandboxes (and the workspace's group)."""

ROOT_CAPABILITIES = {
    "CHOWN": "package managers (dpkg, npm -g, pip) chown the files they install",
    "DAC_OVERRIDE": "root reads and writes files it does not own, as build scripts expect",
    "FOWNER": "chmod and utime on files of other users (tar and dpkg extraction)",
    "FSETID": "installing files keeps their setgid bits",
    "SETGID": "apt and su drop to other groups",
    "SETUID": "apt drops to its _apt user; su and setpriv in build scripts",
    "KILL": "root signals processes of other users in its own sandbox",
}
"""Capabilities kept for root-in-sandbox builds, with why; every other one is dropped
(notably NET_RAW, MKNOD, SYS_CHROOT, SETPCAP, SETFCAP, AUDIT_WRITE, NET_BIND_SERVICE,
which Docker's default set would keep). Non-root sandboxes keep none."""

NAMESPACE_LABEL = "kubernetes.io/metadata.name"
SERVICE_ACCOUNT = "sbx-sandbox"
"""A service account of their own, with no binding and no token (deploy/ creates it), so
sandboxes never share the namespace's ``default`` one and whatever gets bound to it."""
CA_CONFIGMAP = "sbx-proxy-ca"
"""ConfigMap in the sandbox namespace holding the proxies' CA certificate (``proxy-ca.pem``)."""
CA_DIR = "/etc/sbx/ca"
TRUST_DIR = "/etc/sbx/trust"
BUNDLE = f"{TRUST_DIR}/ca-bundle.pem"
REQUEST_CPUS = 0.1
REQUEST_MEMORY = 256 * 1024**2
"""What the scheduler reserves per sandbox (idle sandboxes use next to nothing); the limits
are the spec's."""
HOLD_COMMAND = ["/bin/sh", "-c", "trap 'exit 0' TERM INT; while :; do sleep 3600 & wait $!; done"]
"""The pod's main process: holds the sandbox open and exits at once on SIGTERM."""


def _quantity_cpu(cpus: float) -> str:
    return f"{max(1, math.ceil(cpus * 1000))}m"


def _quantity_bytes(value: int) -> str:
    return f"{max(1, value // 1024**2)}Mi"


def spec_json(spec: api.SandboxSpec) -> str:
    return json.dumps(msgspec.to_builtins(spec), sort_keys=True, separators=(",", ":"))


def workspace_claim(spec: api.SandboxSpec, settings: KubernetesSettings) -> dict[str, Any]:
    claim: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {
            "name": names.claim_name(spec.sandbox_id),
            "namespace": settings.namespace,
            "labels": names.labels(spec.sandbox_id, spec.labels),
            "annotations": {names.SANDBOX_ID: spec.sandbox_id, names.SPEC: spec_json(spec)},
        },
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": settings.workspace_size}},
        },
    }
    if settings.storage_class:
        claim["spec"]["storageClassName"] = settings.storage_class
    if spec.snapshot is not None:  # provisioned with the snapshot's content (CSI)
        claim["spec"]["dataSource"] = snapshots.data_source(spec.snapshot)
    return claim


def cache_claim(key: str, settings: KubernetesSettings) -> dict[str, Any]:
    """An organisation's package cache: one ReadWriteMany volume that every sandbox of
    that organisation mounts at ``CACHE_DIR``, and no sandbox of another one ever does.
    Not owned by any sandbox: it outlives them (an operator deletes it)."""
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {
            "name": names.cache_claim_name(key),
            "namespace": settings.namespace,
            "labels": names.cache_labels(key),
        },
        "spec": {
            "accessModes": ["ReadWriteMany"],
            "resources": {"requests": {"storage": settings.cache_size}},
            "storageClassName": settings.cache_storage_class,
        },
    }


def _owner(claim: dict[str, Any]) -> list[dict[str, Any]]:
    meta = claim["metadata"]
    return [{"apiVersion": "v1", "kind": "PersistentVolumeClaim", "name": meta["name"], "uid": meta["uid"]}]


def sandbox_env(spec: api.SandboxSpec, *, proxy_url: str | None) -> list[dict[str, str]]:
    """The environment of every process in the sandbox (exec'd commands inherit it)."""
    env = {
        "HOME": "/root" if spec.run_as_root else "/workspace",
        "GIT_TERMINAL_PROMPT": "0",  # an expired credential makes git fail, never hang
    }
    if spec.cache:
        env |= api.CACHE_ENV
    if proxy_url is not None:
        ca = f"{CA_DIR}/proxy-ca.pem"
        env |= {
            "HTTP_PROXY": proxy_url, "HTTPS_PROXY": proxy_url,
            "http_proxy": proxy_url, "https_proxy": proxy_url,
            "NO_PROXY": "localhost,127.0.0.1,::1", "no_proxy": "localhost,127.0.0.1,::1",
            "SSL_CERT_FILE": BUNDLE, "GIT_SSL_CAINFO": BUNDLE, "REQUESTS_CA_BUNDLE": BUNDLE,
            "CURL_CA_BUNDLE": BUNDLE, "PIP_CERT": BUNDLE, "NODE_EXTRA_CA_CERTS": ca,
        }  # fmt: skip
    return [{"name": k, "value": v} for k, v in env.items()]


def runtime_class(spec: api.SandboxSpec, settings: KubernetesSettings) -> str | None:
    name = settings.strong_runtime_class if spec.isolation == "strong" else settings.runtime_class
    return name or None


# Long on purpose: the pod spec is one literal, read top to bottom like the YAML it becomes.
def pod(
    spec: api.SandboxSpec,
    claim: dict[str, Any],
    settings: KubernetesSettings,
    *,
    image: str,
    proxy_url: str | None,
) -> dict[str, Any]:
    """The sandbox's pod. ``claim`` is the workspace claim as stored (its uid owns the pod)."""
    root = spec.run_as_root
    seccomp: dict[str, str] = {"type": "RuntimeDefault"}
    if settings.seccomp_profile.startswith("localhost/"):
        seccomp = {
            "type": "Localhost",
            "localhostProfile": settings.seccomp_profile.removeprefix("localhost/"),
        }
    memory = _quantity_bytes(spec.limits.memory_bytes)
    container: dict[str, Any] = {
        "name": names.CONTAINER,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": HOLD_COMMAND,
        "workingDir": "/workspace",
        "env": sandbox_env(spec, proxy_url=proxy_url),
        "stdin": False,
        "tty": False,
        "securityContext": {
            "privileged": False,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": not spec.writable_root,
            "runAsNonRoot": not root,
            "runAsUser": 0 if root else SANDBOX_UID,
            "runAsGroup": 0 if root else SANDBOX_UID,
            "capabilities": {"drop": ["ALL"], "add": sorted(ROOT_CAPABILITIES) if root else []},
            "procMount": "Default",
            "seccompProfile": seccomp,
        },
        "resources": {
            "requests": {
                "ephemeral-storage": "100Mi",
                "cpu": _quantity_cpu(min(spec.limits.cpus, REQUEST_CPUS)),
                "memory": _quantity_bytes(min(spec.limits.memory_bytes, REQUEST_MEMORY)),
            },
            "limits": {
                "cpu": _quantity_cpu(spec.limits.cpus),
                "memory": memory,
                "ephemeral-storage": settings.scratch_size,
            },
        },
        "volumeMounts": [
            {"name": "workspace", "mountPath": "/workspace", "subPath": "workspace"},
            {"name": "workspace", "mountPath": "/.sbx", "subPath": "control"},
            {"name": "tmp", "mountPath": "/tmp"},  # noqa: S108 - the pod's own emptyDir
            {"name": "trust", "mountPath": TRUST_DIR},
        ],
    }
    volumes: list[dict[str, Any]] = [
        {"name": "workspace", "persistentVolumeClaim": {"claimName": claim["metadata"]["name"]}},
        {"name": "tmp", "emptyDir": {"sizeLimit": settings.scratch_size}},
        {"name": "trust", "emptyDir": {"medium": "Memory", "sizeLimit": "4Mi"}},
    ]
    if spec.cache:
        container["volumeMounts"].append({"name": "cache", "mountPath": api.CACHE_DIR})
        volumes.append(
            {"name": "cache", "persistentVolumeClaim": {"claimName": names.cache_claim_name(spec.cache)}}
        )
    if proxy_url is not None:
        container["volumeMounts"].append({"name": "proxy-ca", "mountPath": CA_DIR, "readOnly": True})
        volumes.append({"name": "proxy-ca", "configMap": {"name": CA_CONFIGMAP, "defaultMode": 0o444}})
    body: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": names.object_name(spec.sandbox_id),
            "namespace": settings.namespace,
            "labels": names.labels(spec.sandbox_id, spec.labels),
            "annotations": {names.SANDBOX_ID: spec.sandbox_id},
            "ownerReferences": _owner(claim),
        },
        "spec": {
            "serviceAccountName": SERVICE_ACCOUNT,
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "hostNetwork": False,
            "hostPID": False,
            "hostIPC": False,
            "shareProcessNamespace": False,
            "hostname": "sandbox",
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            # No DNS: names are resolved by the proxy, and the NetworkPolicy allows nothing else.
            "dnsPolicy": "None",
            "dnsConfig": {"nameservers": ["127.0.0.1"]},
            "securityContext": {
                "fsGroup": SANDBOX_UID,
                "fsGroupChangePolicy": "OnRootMismatch",
                "seccompProfile": seccomp,
            },
            "containers": [container],
            "volumes": volumes,
            **(
                {"imagePullSecrets": [{"name": secret} for secret in settings.image_pull_secrets]}
                if settings.image_pull_secrets
                else {}
            ),
        },
    }
    if (rc := runtime_class(spec, settings)) is not None:
        body["spec"]["runtimeClassName"] = rc
    return body


def network_policy(
    spec: api.SandboxSpec, claim: dict[str, Any], settings: KubernetesSettings, *, egress: str
) -> dict[str, Any]:
    """No ingress; egress only to the proxies' pods on the proxy port (``egress="proxy"``)
    or to nothing (``"none"``). Namespaces also carry default-deny policies (deploy/)."""
    key, value = names.PROXY_POD_LABEL
    rules: list[dict[str, Any]] = []
    if egress == "proxy":
        rules.append({
            "to": [{
                "namespaceSelector": {"matchLabels": {NAMESPACE_LABEL: settings.proxy_namespace}},
                "podSelector": {"matchLabels": {key: value}},
            }],
            "ports": [{"protocol": "TCP", "port": settings.proxy_port}],
        })  # fmt: skip
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": names.object_name(spec.sandbox_id),
            "namespace": settings.namespace,
            "labels": names.labels(spec.sandbox_id, spec.labels),
            "ownerReferences": _owner(claim),
        },
        "spec": {
            "podSelector": {"matchLabels": {names.SANDBOX: names.labels(spec.sandbox_id, {})[names.SANDBOX]}},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [],
            "egress": rules,
        },
    }
