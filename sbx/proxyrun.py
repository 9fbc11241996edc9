"""The credential proxy as part of ``sbx up``: where it runs and how it is started.

Locally the proxy is ``proxy/.venv/bin/sbx-proxy`` (mitmdump with the credential addon)
listening on the sandbox network's proxy address. ``sbx up`` runs one, supervised like
the services; scaling a fleet of them is the proxy-scaler's job (not built yet).
"""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

from shared import errors
from shared.runtime import backends

ROOT = Path(__file__).resolve().parent.parent
SBX_PROXY = ROOT / "proxy" / ".venv" / "bin" / "sbx-proxy"


def egress_choice(env: dict[str, str]) -> tuple[str, str | None]:
    """The sandbox egress ``sbx up`` uses, and why it is not ``proxy`` when it is not."""
    asked = env.get("SBX_SANDBOX_EGRESS", "").strip().lower()
    if asked == "none":
        return "none", "SBX_SANDBOX_EGRESS=none"
    problem = backends.egress_problem(env.get("SBX_RUNTIME", "local"))
    if problem is None and not SBX_PROXY.exists():
        problem = f"{SBX_PROXY} is missing (run scripts/setup)"
    if problem is not None:
        if asked == "proxy":
            raise errors.ConfigError(f"SBX_SANDBOX_EGRESS=proxy is not possible here: {problem}")
        return "none", problem
    return "proxy", None


def check_config(env: dict[str, str]) -> None:
    """Stop start-up on a bad SBX_PROXY_CONFIG, with the proxy's own message."""
    path = env.get("SBX_PROXY_CONFIG", "")
    if not path:
        return
    result = subprocess.run(
        [str(SBX_PROXY), "--check", "--config", path], capture_output=True, text=True, timeout=60, check=False
    )
    if result.returncode != 0:
        raise errors.ConfigError(
            (result.stderr or result.stdout).strip() or f"SBX_PROXY_CONFIG={path} is invalid"
        )


def command(state: Path, env: dict[str, str], host: str, port: int) -> list[str]:
    return [
        str(SBX_PROXY),
        "--listen-host", host,
        "--listen-port", str(port),
        "--confdir", str(state / "proxy" / "ca"),
        "--config", env.get("SBX_PROXY_CONFIG", ""),
    ]  # fmt: skip


def ca_certificate(state: Path) -> Path:
    return state / "proxy" / "ca" / "mitmproxy-ca-cert.pem"


async def wait_until_listening(host: str, port: int, exited: asyncio.Event, timeout: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        if exited.is_set():
            raise errors.InfrastructureError("the credential proxy exited at start-up (see proxy.log)")
        try:
            _, writer = await asyncio.open_connection(host, port)
            writer.close()
            return
        except OSError:
            await asyncio.sleep(0.1)
    raise errors.InfrastructureError(f"the credential proxy did not listen on {host}:{port}")
