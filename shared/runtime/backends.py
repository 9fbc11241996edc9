"""Choosing and opening a runtime backend by name: the one place services get a runtime from."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from sbx_api import errors
from shared.runtime import api

if TYPE_CHECKING:
    from shared.infrastructure.settings.runtime import RuntimeSettings
    from shared.runtime.kubernetes.proxies import KubernetesProxies
    from shared.runtime.local.proxies import LocalProxies
    from shared.runtime.local.runtime import LocalRuntime

NAMES = ("local", "kubernetes")


def open_runtime(
    name: str,
    state_dir: Path,
    *,
    egress: str = "none",
    env: Mapping[str, str] | None = None,
    disk_reserve: int | None = None,
    images: RuntimeSettings | None = None,
    tune_host: bool = False,
) -> api.Runtime:
    """The named backend. ``env`` holds the backend's own settings (Kubernetes: the
    ``SBX_K8S_*`` variables); the services pass their environment. ``disk_reserve``:
    free space the local state filesystem keeps (no sandbox starts below it). ``images``:
    where the registry settings come from (the service that pulls images passes them).
    ``tune_host``: the local runtime turns on cgroup2's ``favordynmods`` where it is off
    (the pool-manager asks, ``SBX_CGROUP_FAVOR_DYNMODS``; see ``cgroups.dynmods_remount``)."""
    if name == "kubernetes":
        from shared.infrastructure.settings.kubernetes import KubernetesSettings
        from shared.runtime.kubernetes import runtime as kube

        return kube.KubernetesRuntime(
            KubernetesSettings.from_env(os.environ if env is None else env), egress=egress
        )
    if name == "local":
        from shared.runtime.local import runtime
        from shared.runtime.local.registries import RegistryConfig

        opened = runtime.LocalRuntime(
            state_dir,
            egress=egress,
            disk_reserve=disk_reserve,
            disk_reserve_inodes=images.disk_reserve_inodes if images else None,
            registries=RegistryConfig.load(images.registries_file) if images else None,
            image_max_bytes=images.image_max_bytes if images else None,
            image_max_layers=images.image_max_layers if images else None,
            image_max_entries=images.image_max_entries if images else None,
            pull_timeout=images.pull_timeout if images else None,
            snapshot_budget=images.snapshot_budget if images else None,
        )
        import structlog

        if opened.egress_problem:
            structlog.get_logger(__name__).error(
                "runtime.no_egress", reason=opened.egress_problem, effect="sandboxes get no network"
            )
        if tune_host:
            from shared.runtime.local import cgroups

            structlog.get_logger(__name__).info("runtime.cgroup_moves", outcome=cgroups.favor_dynamic_moves())
        return opened
    raise errors.ConfigError(f"unknown runtime {name!r}; available here: {', '.join(NAMES)}")


def image_runtime(name: str, state_dir: Path, settings: RuntimeSettings) -> LocalRuntime:
    """The runtime whose images this machine holds (local), for ``sbx image``."""
    if name == "local":
        from shared.runtime.local import runtime

        opened = open_runtime(name, state_dir, images=settings, disk_reserve=settings.disk_reserve)
        assert isinstance(opened, runtime.LocalRuntime)
        return opened
    raise errors.ConfigError(
        f"the {name!r} runtime keeps no images here: its nodes pull them (see docs/kubernetes.md)"
    )


# ---- sandbox egress through the credential proxy (what `sbx up` needs to run the proxy) ----


def egress_problem(name: str) -> str | None:
    """Why sandboxes of this backend cannot have proxy-only egress here (None: they can)."""
    if name == "kubernetes":
        return None  # per-sandbox NetworkPolicies; the cluster's CNI must enforce them (docs/kubernetes.md)
    if name == "local":
        from shared.runtime.local import network

        return network.Network().unavailable()
    return f"the {name!r} runtime has no proxy egress here"


async def prepare_egress(name: str) -> None:
    """Host set-up the proxy needs before it can listen (local: firewall, proxy address)."""
    if name == "local":
        from shared.runtime.local import network

        await network.Network().ensure_host()


def open_proxy_fleet(
    name: str, state_dir: Path, runtime: api.Runtime, *, binary: str, config: str
) -> LocalProxies | KubernetesProxies:
    """The backend's credential-proxy fleet (local: ``sbx-proxy`` processes, see proxies.py)."""
    if name == "local":
        from shared.runtime.local import proxies
        from shared.runtime.local import runtime as local

        assert isinstance(runtime, local.LocalRuntime)
        return proxies.LocalProxies(state_dir, runtime, binary=binary, config=config)
    if name == "kubernetes":
        from shared.runtime.kubernetes import proxies as kube_proxies
        from shared.runtime.kubernetes import runtime as kube

        assert isinstance(runtime, kube.KubernetesRuntime)
        return kube_proxies.KubernetesProxies(runtime)
    raise errors.ConfigError(f"the {name!r} runtime has no proxy fleet here")


def sandbox_proxy_url(name: str) -> str:
    """The proxy URL every sandbox of this backend is given."""
    if name == "local":
        from shared.runtime.local import network

        return network.proxy_url()
    raise errors.ConfigError(f"the {name!r} runtime has no proxy egress here")


def local_runtime(name: str, state_dir: Path) -> api.Runtime | None:
    """The runtime whose sandboxes run on this machine under ``state_dir`` (local), to
    stop or remove them without a service; None for a backend whose sandboxes do not."""
    if name != "local":
        return None
    from shared.runtime.local import runtime

    return runtime.LocalRuntime(state_dir)


async def release_host(name: str, state_dir: Path) -> int:
    """With no sandbox of ``state_dir`` running any more: stop its proxies, detach its
    package caches' mounts (their files stay) and remove routes whose links are gone.
    Returns how many proxies were stopped (local only; other backends hold nothing here)."""
    if name != "local":
        return 0
    import asyncio

    from shared.infrastructure.settings import proxies as proxies_settings
    from shared.runtime.local import proxies, runtime

    rt = runtime.LocalRuntime(state_dir)
    await asyncio.to_thread(rt.caches.detach_all)
    fleet = proxies.LocalProxies(state_dir, rt, binary=str(proxies_settings.DEFAULT_PROXY_BIN))
    stopped = len(fleet.records())
    await fleet.stop_all()
    if rt.network.unavailable() is None:
        await rt.network.prune()
    return stopped


async def purge(name: str, state_dir: Path) -> None:
    """Delete every sandbox of a state directory and release the host (tests and
    benchmarks clean up with this; ``sbx down`` records what it does)."""
    if name != "local":
        raise errors.ConfigError(f"the {name!r} runtime cannot be purged from here")
    import asyncio

    if not await asyncio.to_thread(state_dir.exists):
        return
    rt = local_runtime(name, state_dir)
    assert rt is not None
    for info in await rt.list():
        await rt.delete(info.sandbox_id)
    await release_host(name, state_dir)


async def remove_state(name: str, state_dir: Path) -> None:
    """Remove a state dir whose sandboxes are all deleted and whose host is released:
    first detach whatever is still mounted below it (so no removal reaches through a
    mount into a cache or a host directory), then its files."""
    import asyncio
    import shutil

    if name == "local":
        from shared.runtime.local import mounts

        await asyncio.to_thread(mounts.detach_under, state_dir)
    await asyncio.to_thread(shutil.rmtree, state_dir)


async def ensure_proxy_ca(name: str, state_dir: Path, binary: str) -> None:
    """The proxies' CA, created before any sandbox starts (they all trust it)."""
    if name == "local":
        from shared.runtime.local import proxies

        await proxies.ensure_ca(state_dir / "proxy" / "ca", binary)
