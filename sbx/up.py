"""``sbx up``: the embedded NATS server and all six services, supervised."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import os
import signal
import socket
from dataclasses import dataclass
from pathlib import Path

from sbx import natsd, proxyrun, stack, supervisor
from shared.contract import errors, subjects
from shared.infrastructure import bus, health, processenv, settings
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


async def _wait_for_nats(
    bus_settings: settings.BusSettings, child: supervisor.Child | None, log_path: Path | None
) -> None:
    deadline = asyncio.get_running_loop().time() + 15
    while True:
        try:
            nc = await bus.connect(bus_settings, "sbx-up", connect_timeout=1)
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


async def _wait_for_gateway(bus_settings: settings.BusSettings, gateway: supervisor.Child) -> str:
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


async def run(options: Options, env: dict[str, str]) -> int:
    state = options.state_dir
    state.mkdir(parents=True, exist_ok=True, mode=0o700)
    lock = open(state / "up.lock", "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        info = stack.StackInfo.read(state)
        raise errors.Conflict(
            f"another `sbx up` is already running with state dir {state}/"
            + (f" (pid {info.pid})" if info else "")
        ) from None

    # Every service reads these too; checking them here stops a bad value before anything starts.
    settings.LifecycleSettings.from_env(env)
    egress, no_egress_because = proxyrun.egress_choice(env)
    env = {**env, "SBX_SANDBOX_EGRESS": egress}
    runtime_settings = settings.RuntimeSettings.from_env(env)
    proxy_env: tuple[str, ...] = ()
    if egress == "proxy":
        proxy_env = proxyrun.check_config(env)
        # Before any sandbox starts: they all trust it.
        await backends.ensure_proxy_ca(
            runtime_settings.backend, state, settings.ProxySettings.from_env(env).binary
        )
    key, generated = stack.api_key(state, env)
    base = settings.BusSettings.from_env(env)
    drain = settings.ServiceSettings.from_env("sbx", env).drain_timeout
    sup = supervisor.Supervisor(stop_timeout=drain + 5)
    nats_child: supervisor.Child | None = None
    nats_log: Path | None = None
    if env.get("NATS_URL"):
        bus_settings = base
    else:
        if not _port_free("127.0.0.1", options.nats_port):
            raise errors.ConfigError(
                f"port {options.nats_port} on 127.0.0.1 is taken; pass --nats-port, "
                "or set NATS_URL to use a NATS server that is already running"
            )
        token = stack.nats_token(state)
        bus_settings = dataclasses.replace(
            base, nats_url=f"nats://127.0.0.1:{options.nats_port}", nats_token=token
        )
        nats_log = state / "nats.log"
        config = natsd.write_config(state, "127.0.0.1", options.nats_port, token)
        nats_child = await sup.start(
            supervisor.Child(
                "nats-server",
                natsd.command_with_config(config),
                supervisor.child_env(processenv.system(env)),
                output=open(nats_log, "ab"),
            )
        )
    await _wait_for_nats(bus_settings, nats_child, nats_log)
    nats_url = bus_settings.nats_url

    if egress == "proxy":
        proxy_url = backends.sandbox_proxy_url(runtime_settings.backend)
    else:
        proxy_url = ""
        supervisor.say(f"sandboxes get no network: {no_egress_because}")

    common = {
        "NATS_URL": nats_url,
        "NATS_TOKEN": bus_settings.nats_token,
        "SBX_NAMESPACE": base.namespace,
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

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        ready = asyncio.create_task(_wait_for_gateway(bus_settings, gateway))
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait([ready, stopped], return_when=asyncio.FIRST_COMPLETED)
        if ready.done() and egress == "proxy":
            await proxyrun.wait_for_first_proxy(state)  # sandboxes can get out once we say "up"
        if ready.done():
            gateway_url = ready.result()
            stack.StackInfo(os.getpid(), nats_url, base.namespace, gateway_url, nats_child is not None).write(
                state
            )
            key_hint = "$SANDBOX_API_KEY" if env.get("SANDBOX_API_KEY") else f"$(cat {state}/api-key)"
            if generated:
                supervisor.say(f"generated an API key into {state}/api-key (mode 0600)")
            print(
                "\nCloud Agent Sandbox is up.\n"
                f"  REST API  {gateway_url}/v1/sessions   (OpenAPI: {gateway_url}/openapi.json)\n"
                f"  Auth      Authorization: Bearer {key_hint}\n"
                f"  NATS      {nats_url}  (namespace {base.namespace}, "
                f"{'embedded, token in ' + str(state / 'nats-token') if nats_child else 'external'})\n"
                f'  Try       curl -H "Authorization: Bearer {key_hint}" {gateway_url}/v1/sessions\n'
                + (
                    f"  Egress    through the credential proxies (proxy-scaler) at {proxy_url}"
                    f" (config: {env.get('SBX_PROXY_CONFIG') or 'none: injects nothing'})\n"
                    if egress == "proxy"
                    else f"  Egress    none ({no_egress_because})\n"
                )
                + "  Inspect   sbx status | sbx events --follow | sbx replay --verify"
                + (f"  (with --state-dir {state})" if state != Path(stack.DEFAULT_STATE_DIR) else "")
                + "\nStop with Ctrl-C.\n",
                flush=True,
            )
            await stopped
        else:
            ready.cancel()
    finally:
        supervisor.say("stopping services...")
        await sup.stop_all(last=nats_child)
        stack.StackInfo.path(state).unlink(missing_ok=True)
        supervisor.say("stopped")
    return 0
