"""Sandbox egress under ``sbx up``: whether sandboxes get the credential proxy, and
checking its config before anything starts. The proxies themselves are run by the
proxy-scaler service (a fleet sized to the sandboxes), not by ``sbx up``.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from sbx_api import errors
from shared.infrastructure.settings import proxies
from shared.runtime import backends


def egress_choice(env: dict[str, str]) -> tuple[str, str | None]:
    """The sandbox egress ``sbx up`` uses, and why it is not ``proxy`` when it is not."""
    asked = env.get("SBX_SANDBOX_EGRESS", "").strip().lower()
    if asked == "none":
        return "none", "SBX_SANDBOX_EGRESS=none"
    problem = backends.egress_problem(env.get("SBX_RUNTIME", "local"))
    binary = proxies.ProxySettings.from_env(env).binary
    if problem is None and not Path(binary).exists():
        problem = f"{binary} is missing (run scripts/setup)"
    if problem is not None:
        if asked == "proxy":
            raise errors.ConfigError(f"SBX_SANDBOX_EGRESS=proxy is not possible here: {problem}")
        return "none", problem
    return "proxy", None


def check_config(env: dict[str, str]) -> tuple[str, ...]:
    """Stop start-up on a bad SBX_PROXY_CONFIG, with the proxy's own message; the
    environment variables its secrets come from (only the proxies get them)."""
    proxy = proxies.ProxySettings.from_env(env)
    if not proxy.config:
        return ()
    result = subprocess.run(
        [proxy.binary, "--check", "--env-names", "--config", proxy.config],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if result.returncode != 0:
        raise errors.ConfigError(
            (result.stderr or result.stdout).strip() or f"SBX_PROXY_CONFIG={proxy.config} is invalid"
        )
    return tuple(json.loads(result.stdout.strip().splitlines()[-1]))


async def wait_for_first_proxy(state: Path, timeout: float = 60.0) -> None:
    """Until the proxy-scaler's first proxy listens (its record is written then)."""
    import asyncio

    from sbx import supervisor

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        if any((state / "proxies").glob("*.json")):
            return
        await asyncio.sleep(0.1)
    supervisor.say("no credential proxy is up yet; sandboxes wait for one (see proxy-scaler in sbx status)")
