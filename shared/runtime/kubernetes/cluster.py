"""The connection to the Kubernetes API: clients opened once and shared, every call's
errors turned into the project's, the proxies' Service address. What the runtime and the
proxy fleet ask the cluster goes through one :class:`Cluster`."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Awaitable
from typing import Any
from urllib.parse import urlencode

import aiohttp
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.stream import WsApiClient
from kubernetes_asyncio.stream.ws_client import get_websocket_url

from sbx_api import errors
from shared.infrastructure.settings.kubernetes import KubernetesSettings
from shared.runtime.kubernetes import channel


def api_error(exc: ApiException, what: str) -> errors.SandboxError:
    """The project's error for a Kubernetes API error."""
    status = exc.status or 0
    detail = f"{what}: {exc.status} {exc.reason}"
    if status == 404:
        return errors.NotFound(detail)
    if status == 409:
        return errors.Conflict(detail)
    if status in (400, 422):
        return errors.InvalidInput(detail)
    if status in (401, 403):
        return errors.ConfigError(f"{detail} (check the service account's RBAC rules: docs/kubernetes.md)")
    return errors.Unavailable(detail)


class _ExecClient(WsApiClient):
    """WsApiClient that offers v5 and v4 and lets aiohttp negotiate, so ``ws.protocol``
    says which one the server speaks."""

    # The two parents' signatures differ from each other; this one takes what both pass.
    async def request(  # type: ignore[override]
        self, method: str, url: str, query_params: Any = None, headers: Any = None, **kwargs: Any
    ) -> Any:
        expanded: list[tuple[str, str]] = []
        for key, value in query_params or []:
            expanded.extend((key, v) for v in (value if isinstance(value, list) else [value]))
        headers = {k: v for k, v in (headers or {}).items() if k.lower() != "sec-websocket-protocol"}
        target = get_websocket_url(url + ("?" + urlencode(expanded) if expanded else ""))
        return await self.rest_client.pool_manager.ws_connect(
            target, headers=headers, protocols=channel.PROTOCOLS, max_msg_size=0, heartbeat=30
        )


class Cluster:
    def __init__(
        self, settings: KubernetesSettings, configuration: client.Configuration | None = None
    ) -> None:
        self.settings = settings
        self._configuration = configuration
        self._clients: tuple[client.ApiClient, WsApiClient] | None = None
        self._opening = asyncio.Lock()
        self._proxy_url: str | None = None

    async def _open(self) -> tuple[client.ApiClient, WsApiClient]:
        async with self._opening:
            if self._clients is None:
                cfg = self._configuration
                if cfg is None:
                    cfg = client.Configuration()
                    if self.settings.kubeconfig:
                        await config.load_kube_config(
                            config_file=self.settings.kubeconfig, client_configuration=cfg
                        )
                    else:
                        config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
                exec_cfg = copy.copy(cfg)
                exec_cfg.connection_pool_maxsize = 0  # unlimited: every open exec holds one
                self._clients = (client.ApiClient(cfg), _ExecClient(exec_cfg))
        return self._clients

    async def core(self) -> client.CoreV1Api:
        return client.CoreV1Api((await self._open())[0])

    async def networking(self) -> client.NetworkingV1Api:
        return client.NetworkingV1Api((await self._open())[0])

    async def apps(self) -> client.AppsV1Api:
        return client.AppsV1Api((await self._open())[0])

    async def custom(self) -> client.CustomObjectsApi:
        return client.CustomObjectsApi((await self._open())[0])

    async def exec_core(self) -> client.CoreV1Api:
        """The core API over the websocket client (exec streams)."""
        return client.CoreV1Api((await self._open())[1])

    async def as_dict(self, model: Any) -> Any:
        """An API model as the plain JSON-ready structure the API would send."""
        return (await self._open())[0].sanitize_for_serialization(model)

    async def close(self) -> None:
        if self._clients is not None:
            for c in self._clients:
                await c.close()
            self._clients = None

    async def call(self, what: str, coro: Awaitable[Any], *, missing_ok: bool = False) -> Any:
        """Await an API call; its errors become the project's (``what`` names the call)."""
        try:
            return await coro
        except ApiException as exc:
            if missing_ok and exc.status == 404:
                return None
            raise api_error(exc, what) from None
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise errors.Unavailable(f"{what}: the Kubernetes API is unreachable: {exc}") from exc

    async def proxy_url(self) -> str:
        """The proxies' Service by cluster IP: sandboxes have no DNS."""
        if self._proxy_url is None:
            core = await self.core()
            service = await self.call(
                f"reading the proxy Service {self.settings.proxy_service}",
                core.read_namespaced_service(self.settings.proxy_name, self.settings.proxy_namespace),
            )
            ip = service.spec.cluster_ip
            if not ip or ip == "None":
                raise errors.ConfigError(f"the proxy Service {self.settings.proxy_service} has no cluster IP")
            host = f"[{ip}]" if ":" in ip else ip
            self._proxy_url = f"http://{host}:{self.settings.proxy_port}"
        return self._proxy_url
