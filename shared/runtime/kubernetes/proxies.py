"""The credential-proxy fleet on Kubernetes: the proxies' Deployment (``SBX_K8S_PROXY_SERVICE``
names both it and its Service), sized through its scale subresource. Each running pod
that is not terminating is one proxy (readiness only decides whether the Service sends
it connections: a pod that flaps is not a proxy that died).

Sandboxes reach the fleet through the Service (``pinned = False``), so there is nothing
to route per sandbox. Draining is the Deployment's: a pod being removed leaves the
Service's endpoints at once and keeps its open connections through its ``preStop`` pause
(deploy/kubernetes/base/proxy.yaml).
"""

from __future__ import annotations

from typing import Any

from sbx_api import errors
from shared.infrastructure.settings.kubernetes import KubernetesSettings
from shared.runtime.kubernetes.runtime import KubernetesRuntime


class KubernetesProxies:
    pinned = False
    """Sandboxes are not routed to one proxy each: the Service balances them."""

    def __init__(self, runtime: KubernetesRuntime) -> None:
        self.runtime = runtime
        self.settings: KubernetesSettings = runtime.settings
        self.ns, self.name = self.settings.proxy_namespace, self.settings.proxy_name
        self._selector: str | None = None

    async def ensure_ca(self) -> None:
        """The CA is the operator's Secret (deploy/README.md); nothing to create here."""

    async def replicas(self) -> int:
        apps = await self.runtime.cluster.apps()
        scale = await self.runtime.cluster.call(
            f"reading the scale of Deployment {self.ns}/{self.name}",
            apps.read_namespaced_deployment_scale(self.name, self.ns),
        )
        return int(scale.spec.replicas or 0)

    async def scale(self, replicas: int) -> None:
        if replicas < 0:
            raise errors.InvalidInput("a fleet cannot have fewer than 0 proxies")
        apps = await self.runtime.cluster.apps()
        await self.runtime.cluster.call(
            f"scaling Deployment {self.ns}/{self.name}",
            apps.patch_namespaced_deployment_scale(self.name, self.ns, {"spec": {"replicas": replicas}}),
        )

    async def _pod_selector(self) -> str:
        if self._selector is None:
            apps = await self.runtime.cluster.apps()
            deployment = await self.runtime.cluster.call(
                f"reading Deployment {self.ns}/{self.name}",
                apps.read_namespaced_deployment(self.name, self.ns),
            )
            labels = deployment.spec.selector.match_labels or {}
            if not labels:
                raise errors.ConfigError(f"Deployment {self.ns}/{self.name} has no matchLabels selector")
            self._selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        return self._selector

    async def ready(self) -> dict[str, str]:
        """Proxy pod name → ``ip:port``, for every running pod that is not terminating."""
        core = await self.runtime.cluster.core()
        pods = await self.runtime.cluster.call(
            "listing proxy pods", core.list_namespaced_pod(self.ns, label_selector=await self._pod_selector())
        )
        port = self.settings.proxy_port

        def endpoint(ip: str) -> str:
            return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"

        return {p.metadata.name: endpoint(p.status.pod_ip) for p in pods.items if _serving(p)}

    async def close(self) -> None:
        await self.runtime.close()


def _serving(pod: Any) -> bool:
    if pod.metadata.deletion_timestamp is not None or pod.status is None or not pod.status.pod_ip:
        return False
    return bool(pod.status.phase == "Running")
