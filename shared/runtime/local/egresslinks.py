"""A local sandbox's way out: with ``proxy`` egress, a link to its assigned credential proxy
and nothing else (``network.py``), the proxy's address in its environment and the proxy's
CA certificate (public part only) trusted inside; with ``none``, loopback only.

While a sandbox runs with a link, ``net.json`` in its directory records the link (address,
host-side index, and the pid of the init it was made for: a record of an earlier run is
ignored).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from sbx_api import errors
from shared.contract import ids
from shared.runtime.local import images, network, sandboxdirs

CA_DIR = "/etc/sbx"
"""Where the proxy's CA and the bundle with it are shown inside a sandbox."""
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
NO_PROXY = "localhost,127.0.0.1,::1"


def proxy_env(url: str) -> dict[str, str]:
    """What every process of a sandbox with proxy egress gets: the proxy, and the CA bundle
    in the variable each tool reads (git, Python, curl and Node each read another)."""
    bundle, ca = f"{CA_DIR}/ca-bundle.pem", f"{CA_DIR}/proxy-ca.pem"
    return {
        "HTTP_PROXY": url, "HTTPS_PROXY": url, "http_proxy": url, "https_proxy": url,
        "NO_PROXY": NO_PROXY, "no_proxy": NO_PROXY,
        "SSL_CERT_FILE": bundle, "GIT_SSL_CAINFO": bundle, "REQUESTS_CA_BUNDLE": bundle,
        "CURL_CA_BUNDLE": bundle, "PIP_CERT": bundle, "NODE_EXTRA_CA_CERTS": ca,
    }  # fmt: skip


class EgressLinks:
    """The egress of the sandboxes in ``dirs``: ``mode`` is ``proxy`` only where it can work
    here (else ``problem`` says why, and sandboxes get no network)."""

    def __init__(
        self, state_dir: Path, dirs: sandboxdirs.SandboxDirs, wanted: str, proxy_ca: Path | None
    ) -> None:
        self.state_dir = state_dir
        self.dirs = dirs
        self.network = network.Network()
        self.problem = self.network.unavailable() if wanted == "proxy" else None
        self.mode = "proxy" if wanted == "proxy" and self.problem is None else "none"
        self.proxy_ca = proxy_ca or state_dir / "proxy" / "ca" / "mitmproxy-ca-cert.pem"

    def env(self) -> dict[str, str]:
        return proxy_env(network.proxy_url()) if self.mode == "proxy" else {}

    def ca_files(self, image: images.Image) -> tuple[tuple[Path, str], ...]:
        """The proxy's CA (public certificate only) and a bundle with the host's roots."""
        if self.mode != "proxy":
            return ()
        try:
            ca = self.proxy_ca.read_bytes()
        except OSError:
            raise errors.InfrastructureError(
                f"the proxy's CA certificate is missing ({self.proxy_ca}): is the proxy running?"
            ) from None
        if b"PRIVATE KEY" in ca:
            raise errors.ConfigError(
                f"{self.proxy_ca} holds a private key: give sandboxes the certificate only"
            )
        bundle = self.state_dir / "proxy" / "ca-bundle.pem"
        roots = HOST_CA_BUNDLE.read_bytes() if HOST_CA_BUNDLE.exists() else b""
        wanted = roots.rstrip(b"\n") + b"\n" + ca
        if not bundle.exists() or bundle.read_bytes() != wanted:
            bundle.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            tmp = bundle.with_name(f".{bundle.name}.{os.getpid()}")
            tmp.write_bytes(wanted)
            tmp.rename(bundle)
        files = [(self.proxy_ca, f"{CA_DIR}/proxy-ca.pem"), (bundle, f"{CA_DIR}/ca-bundle.pem")]
        if image.trust_store:  # the image's own trust store, where it has one
            files.append((bundle, str(HOST_CA_BUNDLE)))
        return tuple(files)

    async def attach(self, d: Path, sandbox_id: str, pid: int) -> None:
        """The started sandbox's link to its proxy, recorded in its directory."""
        slot = await self.network.attach(ids.token(sandbox_id), pid)
        (d / "net.json").write_text(
            json.dumps({"address": slot.sandbox_ip, "ifindex": slot.ifindex, "pid": pid})
        )

    def link(self, sandbox_id: str) -> int | None:
        """The host-side index of the sandbox's proxy link while it runs (None: none)."""
        record = self.record(sandbox_id)
        return None if record is None else int(record["ifindex"])

    def address(self, sandbox_id: str) -> str | None:
        """The sandbox's address on its proxy link while it runs (what its proxy sees)."""
        record = self.record(sandbox_id)
        return None if record is None else str(record["address"])

    def record(self, sandbox_id: str) -> dict[str, Any] | None:
        d = self.dirs.dir(sandbox_id)
        running = self.dirs.running(d)
        try:
            record = json.loads((d / "net.json").read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(record, dict) or running is None or record.get("pid") != running.pid:
            return None  # from an earlier run: the link is gone
        return record
