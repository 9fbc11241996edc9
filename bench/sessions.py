"""Sustained session create/get: through REST (gateway) and through NATS directly.

Starts its own nats-server, one scheduler and one gateway as separate processes, then
drives both paths from this process with the same concurrency, in the same run, and
prints p50/p99 latency, throughput, and the REST/NATS ratio. Prints figures only; it
asserts nothing about time.

    .venv/bin/python bench/sessions.py [--sessions 2000] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common
from shared.contract import codec, commands, ids, subjects
from shared.domain import projections
from shared.infrastructure import bus, eventstore, health, projector
from shared.infrastructure.settings import bus as bus_settings

KEY = "bench-key-0123456789abcdef"


async def timed(samples: list[float], coro) -> None:
    start = time.perf_counter()
    await coro
    samples.append(time.perf_counter() - start)


async def drive(n: int, concurrency: int, one) -> tuple[list[float], float]:
    samples: list[float] = []
    queue = list(range(n))

    async def worker() -> None:
        while queue:
            i = queue.pop()
            await timed(samples, one(i))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return samples, time.perf_counter() - start


async def main(n: int, concurrency: int) -> None:
    with common.nats_server() as url:
        namespace = "bench"
        env = {
            **os.environ,
            "NATS_URL": url,
            "SBX_NAMESPACE": namespace,
            "SANDBOX_API_KEY": KEY,
            "SBX_GATEWAY_PORT": str(common.free_port()),
            "SBX_LOG_LEVEL": "warning",
        }
        procs = [
            subprocess.Popen([sys.executable, "-m", f"services.{m}"], env=env, stderr=subprocess.DEVNULL)
            for m in ("scheduler", "gateway")
        ]
        try:
            nc = await bus.connect(bus_settings.BusSettings(nats_url=url, namespace=namespace), "bench")
            topology = subjects.Topology(namespace)
            js = nc.jetstream()
            while True:  # wait for both services
                try:
                    reports = await health.read_all(js, topology.health_bucket)
                    if {r.service for r in reports if r.status == "ok"} >= {"scheduler", "gateway"}:
                        break
                except Exception:
                    pass
                await asyncio.sleep(0.1)
            sessions = await projector.ProjectionStore.open(
                js, projections.SESSIONS, eventstore.EventStore(js, topology)
            )
            base = f"http://127.0.0.1:{env['SBX_GATEWAY_PORT']}"
            auth = {"Authorization": f"Bearer {KEY}"}
            limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
            async with httpx.AsyncClient(base_url=base, headers=auth, limits=limits, timeout=30) as http:

                async def rest_create(i: int) -> None:
                    r = await http.post("/v1/sessions", json={"session_id": f"rest-{i}"})
                    assert r.status_code == 201, r.text

                async def rest_get(i: int) -> None:
                    r = await http.get(f"/v1/sessions/rest-{i}")
                    assert r.status_code == 200, r.text

                async def nats_create(i: int) -> None:
                    cmd = commands.CreateSession(command_id=ids.new_id(), session_id=f"nats-{i}")
                    reply = codec.decode_reply(
                        (await nc.request(topology.session_commands, codec.encode(cmd), timeout=30)).data
                    )
                    assert reply.ok, reply

                async def nats_get(i: int) -> None:
                    assert await sessions.get(f"nats-{i}") is not None

                await drive(50, concurrency, lambda i: rest_create(10_000_000 + i))  # warm-up
                results = {}
                for label, fn in (
                    ("create via NATS (command)", nats_create),
                    ("create via REST", rest_create),
                    ("get via NATS (KV)", nats_get),
                    ("get via REST", rest_get),
                ):
                    results[label] = await drive(n, concurrency, fn)
            print(
                f"\nsessions benchmark: {n} sessions, concurrency {concurrency}, one scheduler, one gateway\n"
            )
            for label, (samples, seconds) in results.items():
                print(common.row(label, samples, seconds))
            print()
            for op in ("create", "get"):
                rest = common.percentiles(results[f"{op} via REST"][0])
                direct = common.percentiles(
                    results[next(k for k in results if k.startswith(f"{op} via NATS"))][0]
                )
                print(
                    f"{op:6} REST/NATS ratio: p50 {rest['p50'] / direct['p50']:.2f}x  "
                    f"p99 {rest['p99'] / direct['p99']:.2f}x"
                )
            await nc.close()
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(20)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    asyncio.run(main(args.sessions, args.concurrency))
