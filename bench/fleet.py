"""Fleet fill on the local runtime: start time by live count, idle cost, cleanup.

Creates and starts N sandboxes one after another (default image, copy-on-write root,
proxy egress where this host can set it up), timing each start and its phases, and
prints the start time (p50 of the 10 starts just before) at 10, 200, 500, 1,000... live
sandboxes, with the ratio to the 10th. Then, with all of them idle: CPU they use (their
cgroups' cpuacct over a few seconds), memory per sandbox (cgroup p50, host MemAvailable
drop). Then cleanup as the runtime's own stop and delete of every sandbox, and checks
that nothing is left: mounts under the state dir, cgroups, nftables map entries, host
veths, state directories, processes. Figures only; nothing is asserted. Needs root.

    .venv/bin/python bench/fleet.py [--count 1000] [--egress proxy|none] [--disk-mib 10240]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shared.runtime import api
from shared.runtime.local import disk, mounts, sandboxdirs, userns
from shared.runtime.local import runtime as local

MARKS = (10, 100, 200, 300, 400, 500, 1000, 2000, 5000, 10000)
WINDOW = 20


class Phases:
    """Time spent in each named step of the current start (wrapped callables)."""

    def __init__(self) -> None:
        self.now: dict[str, float] = collections.defaultdict(float)

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        if asyncio.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def timed_async(*args: Any, **kwargs: Any) -> Any:
                t = time.perf_counter()
                try:
                    return await fn(*args, **kwargs)
                finally:
                    self.now[name] += time.perf_counter() - t

            return timed_async

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.now[name] += time.perf_counter() - t

        return timed

    def take(self) -> dict[str, float]:
        got, self.now = dict(self.now), collections.defaultdict(float)
        return got


def instrument(rt: local.LocalRuntime, phases: Phases) -> None:
    disk.Disk.open = staticmethod(phases.wrap("disk", disk.Disk.open))  # type: ignore[method-assign]
    object.__setattr__(rt.cgroups, "create", phases.wrap("cgroup", rt.cgroups.create))
    rt.caches.prepare = phases.wrap("cache", rt.caches.prepare)  # type: ignore[method-assign]
    userns.create = phases.wrap("userns", userns.create)
    rt._wait_until_held = phases.wrap("bwrap", rt._wait_until_held)  # type: ignore[method-assign]
    rt.network.attach = phases.wrap("network", rt.network.attach)  # type: ignore[method-assign]


def cpu_seconds(rt: local.LocalRuntime, ids: list[str]) -> float:
    """User + system CPU of every process of the sandboxes (their cgroups' members)."""
    ticks = 0
    for i in ids:
        for pid in rt.cgroups.pids(sandboxdirs.cgroup_name(i)):
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def memory(rt: local.LocalRuntime, sandbox_id: str) -> int:
    for d in rt.cgroups.dirs(sandboxdirs.cgroup_name(sandbox_id)):
        for name in ("memory.usage_in_bytes", "memory.current"):
            if (d / name).exists():
                return int((d / name).read_text())
    return 0


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


async def leftovers(
    rt: local.LocalRuntime, state: Path, tokens: set[str], ifindexes: set[int]
) -> dict[str, int]:
    """What of the fleet is still on the host after cleanup."""
    cgroups = sum(1 for t in tokens for d in rt.cgroups.dirs(f"sbx-{t}") if d.exists())
    routes = await rt.network.routes() if rt.egress == "proxy" else {}
    links = {i for i, _ in socket.if_nameindex()}
    procs = 0
    needle = os.fsencode(state)
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if needle in (p / "cmdline").read_bytes():
                    procs += 1
            except OSError:
                pass
    return {
        "mounts": len(mounts.mounts_under(state)),
        "cgroups": cgroups,
        "nft map entries": sum(1 for i in routes if i in ifindexes),
        "host veths": len(ifindexes & links),
        "state dirs": sum(1 for d in rt.root.iterdir() if d.name != disk.TEMPLATES)
        if rt.root.exists()
        else 0,
        "processes": procs,
    }


async def fill(
    rt: local.LocalRuntime, count: int, phases: Phases, limits: api.Limits
) -> tuple[list[float], list[dict[str, float]], dict[int, float]]:
    listing: dict[int, float] = {}
    starts: list[float] = []
    steps: list[dict[str, float]] = []
    for n in range(count):
        sandbox_id = f"fleet-{n:05d}"
        await rt.create(api.SandboxSpec(sandbox_id=sandbox_id, limits=limits))
        phases.take()
        t = time.perf_counter()
        await rt.start(sandbox_id)
        starts.append(time.perf_counter() - t)
        steps.append(phases.take())
        if n + 1 in MARKS:  # what the reaper's pass asks of the runtime (every SBX_REAPER_INTERVAL)
            t = time.perf_counter()
            await rt.list()
            listing[n + 1] = time.perf_counter() - t
        if (n + 1) % 100 == 0:
            print(f"  {n + 1} live, last start {starts[-1] * 1000:.1f} ms", flush=True)
    return starts, steps, listing


def report_starts(count: int, starts: list[float], steps: list[dict[str, float]]) -> None:
    marks = [m for m in MARKS if m <= count] or [count]
    names = sorted({k for s in steps for k in s})
    print(f"\nstart time by live count (p50 of the {WINDOW} starts up to it; ms)")
    print(f"{'live':>6} {'start':>7} {'ratio':>6} " + " ".join(f"{n:>8}" for n in (*names, "other")))
    first = None
    for m in marks:
        window = range(max(0, m - WINDOW), m)
        p50 = statistics.median(starts[i] for i in window)
        first = first or p50
        cols = []
        for name in names:
            cols.append(statistics.median(steps[i].get(name, 0.0) for i in window) * 1000)
        other = statistics.median(starts[i] - sum(steps[i].values()) for i in window) * 1000
        print(
            f"{m:>6} {p50 * 1000:>7.1f} {p50 / first:>6.2f} " + " ".join(f"{c:>8.1f}" for c in (*cols, other))
        )


async def main(count: int, egress: str, idle_seconds: float, disk_bytes: int) -> None:
    with tempfile.TemporaryDirectory(prefix="sbx-fleet-") as tmp:
        state = Path(os.path.realpath(tmp))
        ca = state / "proxy" / "ca" / "mitmproxy-ca-cert.pem"
        if egress == "proxy":  # a CA certificate of its own, as the proxy would write
            ca.parent.mkdir(parents=True)
            subprocess.run(
                ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
                 "-nodes", "-keyout", "/dev/null", "-out", str(ca), "-days", "1", "-subj", "/CN=bench"],
                check=True, capture_output=True,
            )  # fmt: skip
        rt = local.LocalRuntime(state, egress=egress, proxy_ca=ca)
        print(f"fleet: {count} sandboxes, egress {rt.egress}, disk {disk_bytes // 1024**2 or 'shared'} MiB, "
              f"{os.cpu_count()} cores "
              f"(a shared machine: other work runs alongside)")  # fmt: skip
        phases = Phases()
        instrument(rt, phases)
        before = mem_available()
        t = time.perf_counter()
        limits = api.Limits(disk_bytes=disk_bytes, disk_inodes=65536 if disk_bytes else 0)
        starts, steps, listing = await fill(rt, count, phases, limits)
        filled = time.perf_counter() - t
        ids = [f"fleet-{n:05d}" for n in range(count)]
        print(f"\nfilled to {count} in {filled:.1f} s ({count / filled:.0f}/s with creates)")
        report_starts(count, starts, steps)
        print(
            "runtime.list() (the reaper's pass): "
            + ", ".join(f"{n} live {t * 1000:.0f} ms" for n, t in listing.items())
        )
        ifindexes = {i for i in (rt.egress_link(s) for s in ids) if i is not None}
        tokens = {rt.dirs.dir(s).name for s in ids}

        await asyncio.sleep(2)
        cpu0, wall0 = cpu_seconds(rt, ids), time.perf_counter()
        await asyncio.sleep(idle_seconds)
        cpu = (cpu_seconds(rt, ids) - cpu0) / (time.perf_counter() - wall0)
        per = sorted(memory(rt, s) for s in ids)
        drop = max(0, before - mem_available())
        mib = 1024**2
        p50, top = statistics.median(per) / mib, per[-1] / mib
        each = cpu / count * 1e6
        print(f"\nidle CPU of all {count} sandboxes: {cpu * 100:.2f}% of one core ({each:.1f} us/s each)")
        print(f"memory per idle sandbox: cgroup p50 {p50:.2f} MiB, max {top:.2f} MiB")
        print(f"host MemAvailable drop per sandbox: {drop / count / mib:.2f} MiB")
        print(
            f"host mount table: {len(mounts.mount_points())} entries, "
            f"{len(mounts.mounts_under(state))} of them this fleet's (others: other work on the machine)"
        )

        t = time.perf_counter()
        for chunk in range(0, count, 16):
            await asyncio.gather(*(rt.stop(s) for s in ids[chunk : chunk + 16]))
        stopped = time.perf_counter() - t
        t = time.perf_counter()
        for chunk in range(0, count, 16):
            await asyncio.gather(*(rt.delete(s) for s in ids[chunk : chunk + 16]))
        deleted = time.perf_counter() - t
        if rt.egress == "proxy":
            await rt.network.prune()
        print(f"\ncleanup: stop all {stopped:.1f} s, delete all {deleted:.1f} s")
        left = await leftovers(rt, state, tokens, ifindexes)
        print("left behind: " + ", ".join(f"{k} {v}" for k, v in left.items()))
        rt.caches.detach_all()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--egress", choices=("proxy", "none"), default="proxy")
    parser.add_argument("--idle-seconds", type=float, default=5.0)
    parser.add_argument(
        "--disk-mib",
        type=int,
        default=0,
        help="a filesystem of its own per sandbox (the stack's default: 10240)",
    )
    args = parser.parse_args()
    asyncio.run(main(args.count, args.egress, args.idle_seconds, args.disk_mib * 1024**2))
