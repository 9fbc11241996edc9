"""The environment of every process the product starts: an allowlist, never the caller's.

The shell an operator runs ``sbx up`` from holds secrets (cloud keys, tokens, the proxy's
credential variables) that no sandbox may see and most services do not need, and
anything a sandbox's processes descend from can leak its environment into it (bwrap is
the sandbox's pid 1, and ``/proc/1/environ`` is readable inside). So each kind of
process gets only what it needs, built here:

- ``system``: what any program needs to run (``PATH``, locale, ``HOME``); sandbox
  launchers (bwrap) and the NATS server get this and nothing else;
- ``service``: a service's settings (``SBX_*``), where its traces go (``OTEL_*``) and
  how to reach NATS or Kubernetes; the API keys only where asked for (the gateway);
- a proxy gets ``system`` plus the variables its config names (``*_env``), from the
  process that starts it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

SYSTEM = ("PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR")
"""Variables any program may read to run at all; none of them carries a secret."""

SERVICE = (
    "NATS_URL",
    "NATS_TOKEN",
    "KUBECONFIG",
    "KUBERNETES_SERVICE_HOST",
    "KUBERNETES_SERVICE_PORT",
    "PYTHONPATH",
)
"""Besides ``SBX_*``: how a service reaches NATS and the Kubernetes API."""

KEYS = ("SANDBOX_API_KEY", "SBX_ORG_KEYS")
"""The control plane's API keys: only the gateway gets them."""


def system(env: Mapping[str, str]) -> dict[str, str]:
    """What any program needs from ``env``: ``SYSTEM`` only."""
    return {k: env[k] for k in SYSTEM if k in env}


def service(
    env: Mapping[str, str],
    *,
    keys: bool = False,
    extra: Iterable[str] = (),
    withhold: Iterable[str] = (),
) -> dict[str, str]:
    """A service's environment from ``env``: ``system``, its settings, its tracing
    (``OTEL_*``), NATS and Kubernetes access, the API keys if ``keys``, and the ``extra``
    variables named (the proxy's credential variables, for the service that starts
    proxies). ``withhold``: variables no service but the one given them as ``extra`` gets,
    even named ``SBX_*``."""
    wanted = set(SERVICE) | set(extra) | (set(KEYS) if keys else set())
    secret = set(KEYS) | set(withhold)
    out = system(env)
    for name, value in env.items():
        if name in wanted or (name.startswith(("SBX_", "OTEL_")) and name not in secret):
            out[name] = value
    return out
