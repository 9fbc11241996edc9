"""List cost against history: ``GET /v1/sessions?limit=10`` beside ``GET /v1/sessions/{id}``.

Seeds sessions straight into the session bucket of a private nats-server (the real codec;
a third deleted, ten organisations, three images), runs a real gateway process on it, and
at each size times, interleaved in the same run: GET of one session, the first page of
ten, a page of ten filtered by org + status, and a page deep in the list (its cursor). Prints
p50/p95 and each list's p50 as a multiple of the GET's; asserts nothing about time.

    .venv/bin/python bench/lists.py [--sizes 1000,10000,100000] [--rounds 200]
    .venv/bin/python bench/lists.py --code /work/main   # the gateway of another checkout
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common
from shared.contract import codec, ids, states, subjects
from shared.infrastructure import bus
from shared.infrastructure.settings import bus as bus_settings

KEY = "bench-key-0123456789abcdef"
NAMESPACE = "benchlists"
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def session(n: int) -> states.SessionState:
    return states.SessionState(
        session_id=f"s{n:07d}",
        status="deleted" if n % 3 == 0 else ("stopped" if n % 3 == 1 else "active"),
        org_id=f"org-{n % 10}",
        user_id=f"user-{n % 37}",
        image=("python:3.12", "node:22", None)[n % 3],
        created_at=T0 + timedelta(milliseconds=n),
        updated_at=T0 + timedelta(milliseconds=n),
        last_seq=n + 1,
    )


async def seed(js, topology: subjects.Topology, start: int, stop: int) -> None:
    prefix = f"$KV.{topology.bucket(subjects.SESSION)}."
    for base in range(start, stop, 2000):
        await asyncio.gather(
            *(
                js.publish(prefix + ids.token(f"s{n:07d}"), codec.encode(session(n)))
                for n in range(base, min(stop, base + 2000))
            )
        )


def gateway(url: str, port: int, code: Path) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "NATS_URL": url,
        "SBX_NAMESPACE": NAMESPACE,
        "SANDBOX_API_KEY": KEY,
        "SBX_GATEWAY_PORT": str(port),
        "SBX_LOG_LEVEL": "warning",
    }
    return subprocess.Popen(
        [sys.executable, "-m", "services.gateway"], cwd=code, env=env, stdout=subprocess.DEVNULL
    )


def timed(client: httpx.Client, path: str, params: dict[str, str] | None = None) -> tuple[float, dict]:
    started = time.perf_counter()
    r = client.get(path, params=params)
    elapsed = time.perf_counter() - started
    assert r.status_code == 200, r.text
    return elapsed, r.json()


def measure(client: httpx.Client, size: int, rounds: int) -> dict[str, list[float]]:
    one = f"/v1/sessions/s{size - size % 3 - 1:07d}"  # an active one
    deep = timed(client, "/v1/sessions", {"limit": "1000"})[1].get("next_cursor")
    cases: dict[str, tuple[str, dict[str, str] | None]] = {
        "GET one session": (one, None),
        "list limit=10": ("/v1/sessions", {"limit": "10"}),
        "list org+status": ("/v1/sessions", {"limit": "10", "org_id": "org-4", "status": "active"}),
    }
    if deep:
        cases["list page 2 (cursor)"] = ("/v1/sessions", {"limit": "10", "cursor": deep})
    for path, params in cases.values():  # warm up (the first list starts following the bucket)
        timed(client, path, params)
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, (path, params) in cases.items():
            samples[name].append(timed(client, path, params)[0])
    return samples


def report(size: int, samples: dict[str, list[float]]) -> None:
    get_p50 = statistics.median(samples["GET one session"])
    print(f"\n{size:,} sessions ({size // 3:,} deleted)")
    for name, values in samples.items():
        p50 = statistics.median(values) * 1000
        p95 = sorted(values)[int(len(values) * 0.95)] * 1000
        ratio = statistics.median(values) / get_p50
        print(f"  {name:22} p50 {p50:7.2f} ms  p95 {p95:7.2f} ms  {ratio:5.2f}x GET")


async def run(sizes: list[int], rounds: int, code: Path) -> None:
    with common.nats_server() as url:
        topology = subjects.Topology(NAMESPACE)
        nc = await bus.connect(bus_settings.BusSettings(nats_url=url, namespace=NAMESPACE), "bench")
        js = nc.jetstream()
        await bus.ensure_topology(js, topology)
        port = common.free_port()
        proc = gateway(url, port, code)
        try:
            with httpx.Client(
                base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {KEY}"}, timeout=120
            ) as client:
                deadline = time.monotonic() + 30
                while True:
                    try:
                        if client.get("/healthz").status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    if time.monotonic() > deadline or proc.poll() is not None:
                        raise SystemExit("the gateway did not start")
                    await asyncio.sleep(0.1)
                seeded = 0
                for size in sizes:
                    started = time.perf_counter()
                    await seed(js, topology, seeded, size)
                    seeded = size
                    print(
                        f"(seeded up to {size:,} in {time.perf_counter() - started:.1f} s)", file=sys.stderr
                    )
                    report(size, await asyncio.to_thread(measure, client, size, rounds))
        finally:
            proc.terminate()
            proc.wait(10)
            await nc.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000,100000")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--code", type=Path, default=Path(__file__).resolve().parent.parent)
    args = parser.parse_args()
    asyncio.run(run([int(s) for s in args.sizes.split(",")], args.rounds, args.code))
