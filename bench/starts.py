"""What one sandbox start costs the local runtime: create + start + delete, in a loop.

Figures only (nothing is asserted; needs root). The runtime alone, as the pool-manager
drives it (the default image, the pool-manager's limits with the per-sandbox disk,
proxy egress: a veth and its addresses), without NATS or events. Per sandbox: wall time
of each step and the CPU of this process plus its children (the launcher, the user
namespace's holder, ``ip``; a started sandbox is detached, its own CPU is not here),
sequentially and ``--parallel`` at a time.

    .venv/bin/python bench/starts.py [--n 40] [--parallel 1,8]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shared.contract import ids
from shared.infrastructure.settings import proxies as proxies_settings
from shared.infrastructure.settings import runtime as runtime_settings
from shared.runtime import api, backends
from shared.runtime.local import proxies

EGRESS = os.environ.get("SBX_BENCH_EGRESS", "proxy")


def cpu() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


async def one(runtime: api.Runtime, limits: api.Limits, steps: dict[str, list[float]]) -> None:
    spec = api.SandboxSpec(sandbox_id=f"sb-{ids.new_id()[:12]}", image="default", limits=limits)
    for step, call in (
        ("create", lambda: runtime.create(spec)),
        ("start", lambda: runtime.start(spec.sandbox_id)),
        ("delete", lambda: runtime.delete(spec.sandbox_id)),
    ):
        t0 = time.perf_counter()
        await call()
        steps[step].append(time.perf_counter() - t0)


async def main(n: int, parallel: list[int]) -> None:
    state = Path(tempfile.mkdtemp(prefix="sbx-starts-"))
    defaults = runtime_settings.RuntimeSettings.from_env({})
    limits = api.Limits(disk_bytes=defaults.disk_bytes, disk_inodes=defaults.disk_inodes)
    runtime = backends.open_runtime("local", state, egress=EGRESS)
    await proxies.ensure_ca(
        state / "proxy" / "ca", str(proxies_settings.DEFAULT_PROXY_BIN)
    )  # (sandboxes trust it)
    try:
        await one(runtime, limits, {"create": [], "start": [], "delete": []})  # the image, once
        print(f"local runtime, default image, disk {defaults.disk_bytes // 1024**3} GiB, proxy egress; "
              f"{os.cpu_count()} cores\n")  # fmt: skip
        for width in parallel:
            steps: dict[str, list[float]] = {"create": [], "start": [], "delete": []}
            c0, t0 = cpu(), time.perf_counter()
            for _ in range(0, n, width):
                await asyncio.gather(*(one(runtime, limits, steps) for _ in range(width)))
            wall, used = time.perf_counter() - t0, cpu() - c0
            done = len(steps["start"])
            parts = "  ".join(f"{k} p50 {statistics.median(v) * 1000:6.1f} ms" for k, v in steps.items())
            print(f"{done:4} sandboxes, {width:2} at a time: {done / wall:6.1f} per s, "
                  f"CPU {used / done * 1000:5.1f} ms each;  {parts}")  # fmt: skip
    finally:
        await backends.purge("local", state)
        await runtime.close()
        shutil.rmtree(state, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=40)
    parser.add_argument("--parallel", default="1,8")
    args = parser.parse_args()
    asyncio.run(main(args.n, [int(x) for x in args.parallel.split(",")]))
