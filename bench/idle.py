"""Idle sandboxes held, and memory per idle sandbox, on the local runtime.

Creates N sandboxes (default image, copy-on-write root), lets them sit idle, then
prints the memory each one's cgroup accounts for (p50/max), the host's MemAvailable
drop per sandbox, and the time to create them. Deletes them all afterwards. Figures
only; nothing is asserted. Needs root.

    .venv/bin/python bench/idle.py [--count 200]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shared.runtime import api
from shared.runtime.local import runtime as local
from shared.runtime.local import sandboxdirs


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def usage(rt: local.LocalRuntime, sandbox_id: str) -> int:
    d = rt.cgroups.dirs(sandboxdirs.cgroup_name(sandbox_id))[0]
    for name in ("memory.usage_in_bytes", "memory.current"):
        f = d / name
        if f.exists():
            return int(f.read_text())
    return 0


async def main(count: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        rt = local.LocalRuntime(Path(tmp))
        before = mem_available()
        start = time.perf_counter()
        ids = [f"idle-{n:05d}" for n in range(count)]
        for chunk in range(0, count, 16):
            batch = ids[chunk : chunk + 16]
            await asyncio.gather(*(rt.create(api.SandboxSpec(sandbox_id=i)) for i in batch))
            await asyncio.gather(*(rt.start(i) for i in batch))
        created = time.perf_counter() - start
        await asyncio.sleep(2)
        per = sorted(usage(rt, i) for i in ids)
        drop = max(0, before - mem_available())
        mib = 1024**2
        print(f"\nidle sandboxes: {count} created in {created:.1f} s ({count / created:.0f}/s)")
        print(
            f"cgroup memory per idle sandbox: p50 {statistics.median(per) / mib:.2f} MiB, "
            f"max {per[-1] / mib:.2f} MiB, total {sum(per) / mib:.0f} MiB"
        )
        print(f"host MemAvailable drop per sandbox: {drop / count / mib:.2f} MiB")
        start = time.perf_counter()
        for chunk in range(0, count, 16):
            await asyncio.gather(*(rt.delete(i) for i in ids[chunk : chunk + 16]))
        print(f"deleted in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=200)
    asyncio.run(main(parser.parse_args().count))
