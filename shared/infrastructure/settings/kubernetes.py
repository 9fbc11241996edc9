"""The Kubernetes runtime: where sandbox pods go and how they are built."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from sbx_api import errors
from shared.contract import ids
from shared.infrastructure.settings import values

_K8S_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_K8S_QUANTITY = re.compile(r"\d+(\.\d+)?(Ki|Mi|Gi|Ti|k|M|G|T)?")


@dataclass(frozen=True)
class KubernetesSettings:
    """The Kubernetes runtime (``SBX_RUNTIME=kubernetes``): where sandbox pods go and how
    they are built. Every name here is checked at start-up, never at the first sandbox."""

    namespace: str = "sbx-sandboxes"
    """Namespace of the sandbox pods, their workspaces and NetworkPolicies (``SBX_K8S_NAMESPACE``)."""
    runtime_class: str = "gvisor"
    """RuntimeClass of ordinary sandboxes (``SBX_K8S_RUNTIME_CLASS``; empty: the node's
    default runtime, only for clusters without gVisor, and said so in the logs)."""
    strong_runtime_class: str = "kata"
    """RuntimeClass for ``use_kata`` (``SBX_K8S_STRONG_RUNTIME_CLASS``; empty: refused)."""
    images: tuple[tuple[str, str], ...] = (("default", "ghcr.io/cloud-agent-sandbox/sandbox:0.1.0"),)
    """Short names and the references they stand for (``SBX_K8S_IMAGES``:
    ``name=reference,...``; must name ``default``). Any other image is used as the
    reference it is: the kubelet pulls it."""
    image_pull_secrets: tuple[str, ...] = ()
    """Secrets (``kubernetes.io/dockerconfigjson``, in the sandboxes' namespace) the
    kubelet pulls sandbox images with (``SBX_K8S_IMAGE_PULL_SECRETS``: ``name,...``)."""
    storage_class: str = ""
    """StorageClass of workspace volumes (``SBX_K8S_STORAGE_CLASS``; empty: the cluster default)."""
    workspace_size: str = "10Gi"
    """Size of each workspace volume (``SBX_K8S_WORKSPACE_SIZE``)."""
    scratch_size: str = "10Gi"
    """Most node disk a sandbox may fill outside its workspace: root filesystem changes,
    ``/tmp``, logs (``SBX_K8S_SCRATCH_SIZE``; the pod is evicted beyond it)."""
    cache_storage_class: str = ""
    """StorageClass of the per-organisation package caches (``SBX_K8S_CACHE_STORAGE_CLASS``).
    It must offer ReadWriteMany (NFS, CephFS, EFS, Filestore...): every sandbox of one
    organisation mounts its cache at once. Empty: no package caches on Kubernetes."""
    cache_size: str = "20Gi"
    """Size of each organisation's package cache volume (``SBX_K8S_CACHE_SIZE``)."""
    proxy_service: str = "sbx-system/sbx-proxy"
    """The credential proxies' Service, ``namespace/name`` (``SBX_K8S_PROXY_SERVICE``)."""
    proxy_port: int = 3128
    seccomp_profile: str = "RuntimeDefault"
    """``RuntimeDefault`` or ``localhost/<file>`` installed on every node (``SBX_K8S_SECCOMP``;
    the product's profile is deploy/kubernetes/base/seccomp/sbx-sandbox.json)."""
    start_timeout: float = 120.0
    """How long a pod may take to become ready, image pull included (``SBX_K8S_START_TIMEOUT``)."""
    kubeconfig: str = ""
    """A kubeconfig file (``KUBECONFIG``); empty: the in-cluster service account."""
    snapshot_class: str = ""
    """The CSI VolumeSnapshotClass snapshots of workspace claims are made with
    (``SBX_K8S_SNAPSHOT_CLASS``; empty: no snapshots on this cluster, said plainly)."""

    def image(self, name: str) -> str:
        """The reference a sandbox of ``name`` runs: its alias's, or ``name`` itself."""
        return dict(self.images).get(name) or name

    @property
    def proxy_namespace(self) -> str:
        return self.proxy_service.split("/", 1)[0]

    @property
    def proxy_name(self) -> str:
        return self.proxy_service.split("/", 1)[1]

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> KubernetesSettings:
        def name(var: str, default: str, *, empty: bool = False) -> str:
            value = env.get(var, default).strip()
            if (value or not empty) and (len(value) > 63 or not _K8S_NAME.fullmatch(value)):
                raise errors.ConfigError(
                    f"{var}={value!r} is not a Kubernetes name (1-63 of a-z, 0-9 and '-')"
                )
            return value

        def name_of(var: str, value: str) -> str:
            value = value.strip()
            if len(value) > 253 or not re.fullmatch(r"[a-z0-9]([a-z0-9.-]*[a-z0-9])?", value):
                raise errors.ConfigError(f"{var}: {value!r} is not a Kubernetes object name")
            return value

        images = tuple(_k8s_images(env.get("SBX_K8S_IMAGES", ""))) or cls.images
        proxy = env.get("SBX_K8S_PROXY_SERVICE", cls.proxy_service).strip()
        parts = proxy.split("/")
        if len(parts) != 2 or not all(_K8S_NAME.fullmatch(p) for p in parts):
            raise errors.ConfigError(f"SBX_K8S_PROXY_SERVICE={proxy!r} must be namespace/name")
        size = env.get("SBX_K8S_WORKSPACE_SIZE", cls.workspace_size).strip()
        if not _K8S_QUANTITY.fullmatch(size):
            raise errors.ConfigError(f"SBX_K8S_WORKSPACE_SIZE={size!r} is not a quantity such as 10Gi")
        scratch = env.get("SBX_K8S_SCRATCH_SIZE", cls.scratch_size).strip()
        if not _K8S_QUANTITY.fullmatch(scratch):
            raise errors.ConfigError(f"SBX_K8S_SCRATCH_SIZE={scratch!r} is not a quantity such as 10Gi")
        cache_size = env.get("SBX_K8S_CACHE_SIZE", cls.cache_size).strip()
        if not _K8S_QUANTITY.fullmatch(cache_size):
            raise errors.ConfigError(f"SBX_K8S_CACHE_SIZE={cache_size!r} is not a quantity such as 20Gi")
        seccomp = env.get("SBX_K8S_SECCOMP", cls.seccomp_profile).strip()
        if seccomp != "RuntimeDefault" and not re.fullmatch(r"localhost/[A-Za-z0-9._/-]+\.json", seccomp):
            raise errors.ConfigError(
                f"SBX_K8S_SECCOMP={seccomp!r} must be RuntimeDefault or localhost/<profile>.json"
            )
        return cls(
            namespace=name("SBX_K8S_NAMESPACE", cls.namespace),
            runtime_class=name("SBX_K8S_RUNTIME_CLASS", cls.runtime_class, empty=True),
            strong_runtime_class=name("SBX_K8S_STRONG_RUNTIME_CLASS", cls.strong_runtime_class, empty=True),
            images=images,
            image_pull_secrets=tuple(
                name_of("SBX_K8S_IMAGE_PULL_SECRETS", part)
                for part in env.get("SBX_K8S_IMAGE_PULL_SECRETS", "").split(",")
                if part.strip()
            ),
            storage_class=name("SBX_K8S_STORAGE_CLASS", cls.storage_class, empty=True),
            workspace_size=size,
            scratch_size=scratch,
            cache_storage_class=name("SBX_K8S_CACHE_STORAGE_CLASS", cls.cache_storage_class, empty=True),
            cache_size=cache_size,
            proxy_service=proxy,
            seccomp_profile=seccomp,
            start_timeout=values.duration(env, "SBX_K8S_START_TIMEOUT", cls.start_timeout, minimum=1),
            kubeconfig=env.get("KUBECONFIG", "").strip(),
            snapshot_class=name_of("SBX_K8S_SNAPSHOT_CLASS", env["SBX_K8S_SNAPSHOT_CLASS"])
            if env.get("SBX_K8S_SNAPSHOT_CLASS", "").strip()
            else "",
        )


def _k8s_images(raw: str) -> list[tuple[str, str]]:
    pairs: list[tuple[str, str]] = []
    for item in filter(None, (part.strip() for part in raw.split(","))):
        image_name, sep, reference = item.partition("=")
        if not sep or not image_name.strip() or not reference.strip():
            raise errors.ConfigError(f"SBX_K8S_IMAGES: {item!r} is not name=reference")
        try:
            ids.validate_image(reference.strip())
            ids.validate_image(image_name.strip())
        except errors.InvalidInput as exc:
            raise errors.ConfigError(f"SBX_K8S_IMAGES: {exc.message}") from None
        pairs.append((image_name.strip(), reference.strip()))
    if pairs and "default" not in dict(pairs):
        raise errors.ConfigError("SBX_K8S_IMAGES must name a 'default' image")
    return pairs
