"""The proxy fleet's metrics with real parts (proxy-scaler, pool-manager and scheduler
in-process, real sandboxes with proxy-only egress, real ``sbx-proxy`` processes):

* a sandbox's traffic moves its proxy's counters, and the proxy-scaler's ``/metrics``
  re-exports them labelled with the proxy's id;
* from inside a real sandbox, nothing reaches any metrics: not the proxy's unix socket
  (not in the sandbox's file system), not the proxy's own port asked directly, not the
  scaler's ``/metrics`` (host loopback) asked directly or through the proxy, not the other
  fleet ports.
"""

from __future__ import annotations

import asyncio
import urllib.request

import pytest

from shared.infrastructure.settings import proxies as proxies_settings
from shared.runtime.local import network
from tests.integration.test_proxy_fleet import FLEET, LIFECYCLE, RUNTIME, ensure, eventually
from tests.proxy import harness

pytestmark = [
    pytest.mark.needs_root("veth pairs and nftables need root"),
    pytest.mark.skipif(network.Network().unavailable() is not None, reason="ip/nft missing"),
    pytest.mark.skipif(
        not proxies_settings.DEFAULT_PROXY_BIN.exists(), reason="proxy/.venv missing: run scripts/setup"
    ),
    pytest.mark.slow,
]


@pytest.fixture
async def fleet(nats_server, namespace, tmp_path):
    """As test_proxy_fleet's, with the proxy-scaler serving its /metrics on a loopback port."""
    from services.pool_manager import app as pool_app
    from services.proxy_scaler import app as scaler_app
    from services.scheduler import app as scheduler_app
    from shared.runtime.local import proxies
    from shared.runtime.local import runtime as local
    from tests import support

    state = tmp_path / "state"
    scaler = await support.start_in_process(
        nats_server.url, namespace, "proxy-scaler", scaler_app.make_setup(RUNTIME, FLEET),
        state_dir=state, metrics_port=0,
    )  # fmt: skip
    running = [scaler] + [
        await support.start_in_process(nats_server.url, namespace, name, setup, state_dir=state)
        for name, setup in (
            ("scheduler", scheduler_app.make_setup(LIFECYCLE)),
            ("pool-manager", pool_app.make_setup(RUNTIME, LIFECYCLE)),
        )
    ]
    details = await support.wait_for_health(nats_server.url, namespace, "proxy-scaler", key="metrics")
    nc, topology = await support.connect(nats_server.url, namespace)
    rt = local.LocalRuntime(state, egress="proxy")
    world = {
        "nc": nc,
        "topology": topology,
        "rt": rt,
        "local": proxies.LocalProxies(state, rt, binary=FLEET.binary),
        "metrics_url": details["metrics"],
        "details": details,
    }
    yield world
    for r in reversed(running):
        await r.stop()
    await nc.close()
    for info in await rt.list():
        await rt.delete(info.sandbox_id)
    await world["local"].stop_all()


async def in_sandbox(world, sandbox: str, script: str) -> str:
    _, out, err = await world["rt"].run(sandbox, ["sh", "-c", script], timeout=120)
    return out.decode(errors="replace") + err.decode(errors="replace")


def scaler_samples(world) -> dict:
    with urllib.request.urlopen(world["metrics_url"], timeout=10) as answer:
        return harness.parse_metrics(answer.read().decode())


async def test_a_sandbox_moves_its_proxy_counters_and_the_scaler_reexports_them(fleet):
    sandbox = await ensure(fleet, "m1")
    record = fleet["local"].records()[0]
    socket_path = fleet["local"].metrics_socket(record)
    assert "metrics.sock" in fleet["details"]["proxy_metrics"]

    async def serving() -> bool:  # (a proxy opens its socket once it runs: a moment after it listens)
        return socket_path.exists()

    await eventually(serving)
    before = harness.parse_metrics(harness.scrape_unix(socket_path))
    out = await in_sandbox(
        fleet, sandbox, "curl -sS -o /dev/null -w '%{http_code}' --max-time 10 http://169.254.169.254/latest/"
    )
    assert out.strip() == "502", out

    async def counted() -> dict:
        after = harness.parse_metrics(harness.scrape_unix(socket_path))
        moved = harness.sample(after, "sbx_proxy_refusals_total", reason="metadata_address") - harness.sample(
            before, "sbx_proxy_refusals_total", reason="metadata_address"
        )
        return after if moved == 1 else {}

    for _ in range(100):
        if await counted():
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("the refusal was not counted")

    proxy = {"proxy": record.proxy_id}
    for _ in range(100):  # the scaler exports once it has led a round
        exported = await asyncio.to_thread(scaler_samples, fleet)
        if harness.sample(exported, "sbx_proxy_up", **proxy) == 1:
            break
        await asyncio.sleep(0.1)
    assert harness.sample(exported, "sbx_proxy_up", **proxy) == 1
    assert harness.sample(exported, "sbx_proxy_refusals_total", reason="metadata_address", **proxy) >= 1
    assert harness.sample(exported, "sbx_proxy_connections_total", verdict="refused", **proxy) >= 1
    assert (
        "sbx_proxy_process_resident_memory_bytes",
        (("proxy", record.proxy_id),),
    ) in exported
    assert not any(name.endswith("_created") for name, _ in exported if name.startswith("sbx_proxy_"))


async def test_no_metrics_are_reachable_from_inside_a_sandbox(fleet):
    sandbox = await ensure(fleet, "m2")
    records = fleet["local"].records()
    socket_path = fleet["local"].metrics_socket(records[0])
    assert socket_path.is_socket()
    scaler_port = int(fleet["metrics_url"].rsplit(":", 1)[1].split("/")[0])
    fleet_ports = " ".join(str(p) for p in range(network.PROXY_PORTS[0], network.PROXY_PORTS[1] + 1))
    proxy = network.PROXY_ADDRESS
    script = f"""
        C="curl -sS --max-time 5"
        echo "== socket"; ls -la {socket_path.parent} 2>&1; test -e {socket_path} && echo SOCKET-VISIBLE
        $C --unix-socket {socket_path} http://proxy/metrics 2>&1
        echo "== proxy port, origin-form"; $C --noproxy '*' http://{proxy}:3128/metrics 2>&1
        echo "== scaler through the proxy"   # (NO_PROXY covers loopback: force the proxy)
        P="-x $HTTP_PROXY --noproxy ''"
        $C $P http://127.0.0.1:{scaler_port}/metrics 2>&1
        $C $P -p http://127.0.0.1:{scaler_port}/metrics 2>&1
        $C $P http://{proxy}:{scaler_port}/metrics 2>&1
        $C $P http://localhost:{scaler_port}/metrics 2>&1
        echo "== scaler direct"; $C --noproxy '*' http://{proxy}:{scaler_port}/metrics 2>&1
        $C --noproxy '*' http://127.0.0.1:{scaler_port}/metrics 2>&1
        echo "== fleet ports direct"
        for p in {fleet_ports}; do
            $C --max-time 2 --noproxy '*' http://{proxy}:$p/metrics 2>/dev/null &
        done
        wait
        echo "== done"
    """
    out = await in_sandbox(fleet, sandbox, script)
    print(out)  # what each attempt got (pytest -s)
    assert "== done" in out, out
    assert "SOCKET-VISIBLE" not in out, out
    assert "sbx_proxy_" not in out and "# TYPE" not in out and "process_cpu" not in out, out
    # The host itself reads both, so the checks above did not pass for want of metrics.
    assert "sbx_proxy_connections_total" in harness.scrape_unix(socket_path)
    exported = await asyncio.to_thread(scaler_samples, fleet)
    assert any(name == "sbx_proxy_up" for name, _ in exported)
