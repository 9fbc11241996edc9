"""CPU of starting one command in a sandbox (``runtime.exec`` of the local runtime), from
a process the size of an executor, before and after side by side.

Each version runs in a worker process of its own that imports the executor's modules
(so it maps what an executor maps), starts one sandbox and runs ``--calls`` commands
(``true``) one after another. It reports, per command: the CPU of the worker itself
(the executor's share), of its waited-for children and of its spawner if it has one
(the rest of the start, and ``true``), and the wall time. Figures only; needs root.

    .venv/bin/python bench/spawn.py --base /tmp/base [--calls 300] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def _spawner_cpu(rt: object) -> float:
    """CPU seconds of the runtime's spawner and its reaped children (0 where it has none)."""
    spawner = getattr(rt, "spawner", None)
    pid = getattr(spawner, "pid", None)
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


async def worker(calls: int) -> dict[str, float]:
    import services.executor.app  # noqa: F401 - an executor's address space
    from shared.runtime import api
    from shared.runtime.local import runtime as local

    with tempfile.TemporaryDirectory(prefix="sbx-spawn-bench-") as work:
        rt = local.LocalRuntime(Path(work) / "state")
        await rt.create(api.SandboxSpec(sandbox_id="bench-spawn"))
        await rt.start("bench-spawn")
        try:
            for _ in range(20):
                await rt.run("bench-spawn", ["true"])
            walls: list[float] = []
            me, children, spawner = (
                _cpu(resource.RUSAGE_SELF),
                _cpu(resource.RUSAGE_CHILDREN),
                _spawner_cpu(rt),
            )
            for _ in range(calls):
                t0 = time.perf_counter()
                result, _, _ = await rt.run("bench-spawn", ["true"])
                walls.append(time.perf_counter() - t0)
                assert result.exit_code == 0, result
            me = _cpu(resource.RUSAGE_SELF) - me
            children = _cpu(resource.RUSAGE_CHILDREN) - children
            spawner = _spawner_cpu(rt) - spawner
        finally:
            await rt.delete("bench-spawn")
            await rt.close()
    return {
        "executor_ms": me / calls * 1000,
        "children_ms": (children + spawner) / calls * 1000,
        "total_ms": (me + children + spawner) / calls * 1000,
        "wall_p50_ms": statistics.median(walls) * 1000,
        "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def run_worker(tree: Path, calls: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--worker", str(tree), "--calls", str(calls)],
        cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True, check=False,
    )  # fmt: skip
    if out.returncode != 0:
        raise SystemExit(f"worker in {tree} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base", type=Path, help="a checkout of the other version")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        sys.path.insert(0, str(args.worker))
        print(json.dumps(asyncio.run(worker(args.calls))))
        return
    trees = (
        {"before (--base)": args.base.resolve(), "after (this tree)": HERE}
        if args.base
        else {"this tree": HERE}
    )
    results: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            results[name].append(run_worker(tree, args.calls))
    print(f"\none command (`true`) started in a sandbox, {args.calls} calls x {args.rounds} rounds, "
          f"median of rounds, {os.cpu_count()} cores\n")  # fmt: skip
    keys = ("executor_ms", "children_ms", "total_ms", "wall_p50_ms", "rss_mib")
    print(f"{'':20}" + "".join(f"{k:>14}" for k in keys))
    medians = {
        name: {k: statistics.median(r[k] for r in rows) for k in keys} for name, rows in results.items()
    }
    for name, row in medians.items():
        print(f"{name:20}" + "".join(f"{row[k]:14.3f}" for k in keys))
    if args.base:
        before, after = medians["before (--base)"], medians["after (this tree)"]
        print(f"{'after / before':20}" + "".join(f"{after[k] / before[k]:14.2f}" for k in keys))


if __name__ == "__main__":
    main()
