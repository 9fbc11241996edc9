"""Choosing and opening a runtime backend by name: the one place services get a runtime from."""

from __future__ import annotations

from pathlib import Path

from shared import errors
from shared.runtime import api

NAMES = ("local",)


def open_runtime(name: str, state_dir: Path, *, egress: str = "none", proxy_port: int = 3128) -> api.Runtime:
    if name == "local":
        from shared.runtime.local import runtime

        opened = runtime.LocalRuntime(state_dir, egress=egress, proxy_port=proxy_port)
        if opened.egress_problem:
            import structlog

            structlog.get_logger(__name__).error(
                "runtime.no_egress", reason=opened.egress_problem, effect="sandboxes get no network"
            )
        return opened
    raise errors.ConfigError(f"unknown runtime {name!r}; available here: {', '.join(NAMES)}")


def image_store(name: str, state_dir: Path):  # type: ignore[no-untyped-def]
    """The backend's image registry (local: root filesystems under the state dir)."""
    if name == "local":
        from shared.runtime.local import images

        return images.ImageStore(state_dir / "images")
    raise errors.ConfigError(f"the {name!r} runtime has no local image store")


# ---- sandbox egress through the credential proxy (what `sbx up` needs to run the proxy) ----


def egress_problem(name: str) -> str | None:
    """Why sandboxes of this backend cannot have proxy-only egress here (None: they can)."""
    if name == "local":
        from shared.runtime.local import network

        return network.Network().unavailable()
    return f"the {name!r} runtime has no proxy egress here"


async def prepare_egress(name: str) -> None:
    """Host set-up the proxy needs before it can listen (local: firewall, proxy address)."""
    if name == "local":
        from shared.runtime.local import network

        await network.Network().ensure_host()


def proxy_endpoint(name: str, port: int) -> tuple[str, str]:
    """Where the proxy listens for this backend's sandboxes: (host, URL sandboxes use)."""
    if name == "local":
        from shared.runtime.local import network

        return network.PROXY_ADDRESS, network.proxy_url(port)
    raise errors.ConfigError(f"the {name!r} runtime has no local proxy endpoint")
