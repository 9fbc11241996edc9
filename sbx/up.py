"""``sbx up``: the embedded NATS server and all six services, supervised."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import socket
from dataclasses import dataclass
from pathlib import Path

from sbx import down, natsd, observe, proxyrun, stack, supervisor
from sbx_api import errors
from shared.contract import subjects
from shared.infrastructure import bus, health, processenv
from shared.infrastructure.settings import audit, lifecycle, proxies, runtime, service
from shared.infrastructure.settings import bus as bus_config
from shared.infrastructure.settings import gateway as gateway_settings
from shared.runtime import backends

GATEWAY_READY_TIMEOUT = 60.0


@dataclass(frozen=True)
class Options:
    host: str
    port: int
    state_dir: Path
    nats_port: int


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def _gateway_port(host: str, port: int) -> int:
    """The port the gateway listens on for the whole life of this stack: ``0`` picks a free
    one once (a restarted gateway must come back where agents connect), a taken one is refused."""
    if port == 0:
        return stack.free_port(host)
    if not _port_free(host, port):
        raise errors.ConfigError(f"port {port} on {host} is taken; pass --port (0 picks a free one)")
    return port


async def _wait_for_nats(
    bus_settings: bus_config.BusSettings, child: supervisor.Child | None, log_path: Path | None
) -> None:
    deadline = asyncio.get_running_loop().time() + 15
    while True:
        try:
            nc = await observe.connect_bus(bus_settings, "sbx-up", wait=1)
        except errors.Unavailable:
            if child is not None and child.proc is not None and child.proc.returncode is not None:
                tail = log_path.read_text()[-1500:] if log_path and log_path.exists() else ""
                raise errors.ConfigError(
                    f"nats-server exited with {child.proc.returncode}:\n{tail}"
                ) from None
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.1)
            continue
        await nc.close()
        return


async def _wait_for_gateway(bus_settings: bus_config.BusSettings, gateway: supervisor.Child) -> str:
    topology = subjects.Topology(bus_settings.namespace)
    nc = await bus.connect(bus_settings, "sbx-up")
    try:
        deadline = asyncio.get_running_loop().time() + GATEWAY_READY_TIMEOUT
        while asyncio.get_running_loop().time() < deadline:
            with contextlib.suppress(Exception):  # no bucket yet, or a read raced a restart
                for report in await health.read_all(nc.jetstream(), topology.health_bucket):
                    if report.service == "gateway" and report.pid == gateway.pid and "url" in report.details:
                        return report.details["url"]
            await asyncio.sleep(0.1)
        raise errors.Unavailable("the gateway did not report ready in time; see its log lines above")
    finally:
        await nc.close()


async def _release(state: Path, bus_settings: bus_config.BusSettings, env: dict[str, str]) -> down.Released:
    """Stop this state dir's sandboxes and proxies (``sbx.down``), recording it through the
    stack's NATS if it answers."""
    backend = runtime.RuntimeSettings.from_env(env).backend
    return await down.release_via(state, bus_settings, backend, who="sbx-up")


@dataclasses.dataclass(frozen=True)
class _Egress:
    mode: str
    """``proxy`` or ``none``."""
    why_none: str
    proxy_env: tuple[str, ...]
    """The variables the proxy config names (they go to the proxy-scaler only)."""
    proxy_url: str


async def _egress(state: Path, env: dict[str, str]) -> tuple[dict[str, str], _Egress]:
    """Check the settings every service reads (a bad value stops here, before anything
    starts) and choose the sandboxes' egress; with proxy egress, make the CA first."""
    lifecycle.LifecycleSettings.from_env(env)
    audit.AuditRateSettings.from_env(env)
    bus_config.BusSettings.from_env(env)
    mode, why = proxyrun.egress_choice(env)
    why_none = why or ""
    env = {**env, "SBX_SANDBOX_EGRESS": mode}
    runtime_settings = runtime.RuntimeSettings.from_env(env)
    if mode != "proxy":
        return env, _Egress(mode, why_none, (), "")
    proxy_env = proxyrun.check_config(env)
    # Before any sandbox starts: they all trust it.
    await backends.ensure_proxy_ca(
        runtime_settings.backend, state, proxies.ProxySettings.from_env(env).binary
    )
    return env, _Egress(mode, why_none, proxy_env, backends.sandbox_proxy_url(runtime_settings.backend))


async def _start_nats(
    options: Options, state: Path, env: dict[str, str], sup: supervisor.Supervisor
) -> tuple[bus_config.BusSettings, supervisor.Child | None]:
    """The NATS server of this stack (none with ``NATS_URL``), up and answering."""
    base = bus_config.BusSettings.from_env(env)
    if env.get("NATS_URL"):
        await _wait_for_nats(base, None, None)
        return base, None
    if not _port_free("127.0.0.1", options.nats_port):
        raise errors.ConfigError(
            f"port {options.nats_port} on 127.0.0.1 is taken; pass --nats-port, "
            "or set NATS_URL to use a NATS server that is already running"
        )
    token = stack.nats_token(state)
    bus_settings = dataclasses.replace(
        base, nats_url=f"nats://127.0.0.1:{options.nats_port}", nats_token=token
    )
    log_file = state / "nats.log"
    config = natsd.write_config(state, "127.0.0.1", options.nats_port, token)
    child = await sup.start(
        supervisor.Child(
            "nats-server",
            natsd.command_with_config(config),
            supervisor.child_env(processenv.system(env)),
            output=open(log_file, "ab"),
        )
    )
    await _wait_for_nats(bus_settings, child, log_file)
    return bus_settings, child


async def _start_services(
    options: Options,
    state: Path,
    env: dict[str, str],
    sup: supervisor.Supervisor,
    bus_settings: bus_config.BusSettings,
    key: str,
    proxy_env: tuple[str, ...],
) -> supervisor.Child:
    """The six services; returns the gateway."""
    common = {
        "NATS_URL": bus_settings.nats_url,
        "NATS_TOKEN": bus_settings.nats_token,
        "SBX_NAMESPACE": bus_settings.namespace,
        "SBX_STATE_DIR": str(state.resolve()),
    }
    gateway: supervisor.Child | None = None
    for module in stack.SERVICES:
        is_gateway = module == "gateway"
        # Each service gets its settings and nothing else of this shell's environment:
        # the keys go to the gateway only, the proxy's credential variables only to the
        # proxy-scaler (which hands them to the proxies it starts).
        own_env = processenv.service(
            env, keys=is_gateway, extra=proxy_env if module == "proxy_scaler" else (), withhold=proxy_env
        )
        child = await sup.start(
            supervisor.Child(
                stack.service_name(module),
                supervisor.python_module(f"services.{module}"),
                supervisor.child_env(
                    own_env,
                    **common,
                    SANDBOX_API_KEY=key if is_gateway else None,
                    SBX_GATEWAY_HOST=options.host if is_gateway else None,
                    SBX_GATEWAY_PORT=str(options.port) if is_gateway else None,
                    SBX_INSTANCE_ID=None,  # each process gets its own
                    SBX_METRICS_PORT=None if is_gateway else "0",  # the gateway serves /metrics itself
                ),
            )
        )
        if is_gateway:
            gateway = child
    assert gateway is not None
    return gateway


def _banner(
    state: Path,
    env: dict[str, str],
    bus_settings: bus_config.BusSettings,
    gateway_url: str,
    embedded: bool,
    egress: _Egress,
) -> str:
    key_hint = "$SANDBOX_API_KEY" if env.get("SANDBOX_API_KEY") else f"$(cat {state}/api-key)"
    return (
        "\nCloud Agent Sandbox is up.\n"
        f"  REST API  {gateway_url}/v1/sessions   (OpenAPI: {gateway_url}/openapi.json)\n"
        f"  Auth      Authorization: Bearer {key_hint}\n"
        f"  NATS      {bus_settings.nats_url}  (namespace {bus_settings.namespace}, "
        f"{'embedded, token in ' + str(state / 'nats-token') if embedded else 'external'})\n"
        f'  Try       curl -H "Authorization: Bearer {key_hint}" {gateway_url}/v1/sessions\n'
        + (
            f"  Egress    through the credential proxies (proxy-scaler) at {egress.proxy_url}"
            f" (config: {env.get('SBX_PROXY_CONFIG') or 'none: injects nothing'})\n"
            if egress.mode == "proxy"
            else f"  Egress    none ({egress.why_none})\n"
        )
        + "  Inspect   sbx status | sbx events --follow | sbx replay --verify"
        + (f"  (with --state-dir {state})" if state != Path(stack.DEFAULT_STATE_DIR) else "")
        + "\nStop with Ctrl-C.\n"
    )


async def run(options: Options, env: dict[str, str]) -> int:
    state = options.state_dir
    stop = asyncio.Event()  # from the start: a Ctrl-C or `sbx down` while starting stops cleanly too
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    lock = stack.lock(state)  # noqa: F841  (held until this process ends)
    key, generated = stack.api_key(state, env)
    gateway_settings.GatewaySettings.from_env({**env, "SANDBOX_API_KEY": key})  # a bad key stops here
    env, egress = await _egress(state, env)
    drain = service.ServiceSettings.from_env("sbx", env).drain_timeout
    sup = supervisor.Supervisor(stop_timeout=drain + 5)
    nats_child: supervisor.Child | None = None
    bus_settings: bus_config.BusSettings | None = None

    def publish(phase: str, gateway_url: str | None = None) -> None:
        assert bus_settings is not None
        embedded = nats_child is not None
        url, namespace = bus_settings.nats_url, bus_settings.namespace
        stack.StackInfo(os.getpid(), url, namespace, gateway_url, embedded, phase).write(state)

    async def release() -> None:
        if bus_settings is not None:
            supervisor.say("stopping sandboxes and proxies...")
            supervisor.say((await _release(state, bus_settings, env)).summary())

    try:
        options = dataclasses.replace(options, port=_gateway_port(options.host, options.port))
        bus_settings, nats_child = await _start_nats(options, state, env, sup)
        publish("starting")
        leftovers = await _release(state, bus_settings, env)  # an earlier stack that did not stop
        if leftovers.stopped or leftovers.deleted or leftovers.proxies:
            supervisor.say(f"an earlier stack left these running: {leftovers.summary()}")
        if egress.mode != "proxy":
            supervisor.say(f"sandboxes get no network: {egress.why_none}")
        gateway = await _start_services(options, state, env, sup, bus_settings, key, egress.proxy_env)
        ready = asyncio.create_task(_wait_for_gateway(bus_settings, gateway))
        stopped = asyncio.create_task(stop.wait())
        refused = asyncio.create_task(sup.refused.wait())
        await asyncio.wait([ready, stopped, refused], return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            ready.cancel()
            return supervisor.CONFIG_EXIT if refused.done() else 0
        if egress.mode == "proxy":
            await proxyrun.wait_for_first_proxy(state)  # sandboxes can get out once we say "up"
        gateway_url = ready.result()
        publish("up", gateway_url)
        if generated:
            supervisor.say(f"generated an API key into {state}/api-key (mode 0600)")
        print(_banner(state, env, bus_settings, gateway_url, nats_child is not None, egress), flush=True)
        await asyncio.wait([stopped, refused], return_when=asyncio.FIRST_COMPLETED)
        if refused.done():
            return supervisor.CONFIG_EXIT
    finally:
        if bus_settings is not None:
            publish("stopping")
        supervisor.say("stopping services...")
        await sup.stop_all(last=nats_child, before_last=release)
        stack.StackInfo.path(state).unlink(missing_ok=True)
        supervisor.say("stopped")
    return 0
