"""Helpers shared by the benchmarks: a private nats-server, percentile printing and CPU
accounting of a process tree."""

from __future__ import annotations

import contextlib
import os
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from sbx import natsd


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def nats_server() -> Iterator[str]:
    """A throwaway JetStream server on loopback; yields its URL."""
    with tempfile.TemporaryDirectory() as store:
        port = free_port()
        proc = subprocess.Popen(
            natsd.command(Path(store), "127.0.0.1", port),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                    break
                time.sleep(0.02)
            yield f"nats://127.0.0.1:{port}"
        finally:
            proc.terminate()
            proc.wait(10)


def percentiles(samples: list[float]) -> dict[str, float]:
    """p50/p99/mean in milliseconds."""
    ordered = sorted(samples)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000  # noqa: E731
    return {"p50": pick(0.50), "p99": pick(0.99), "mean": statistics.fmean(ordered) * 1000}


def row(label: str, samples: list[float], seconds: float) -> str:
    p = percentiles(samples)
    return (
        f"{label:34} n={len(samples):6}  p50 {p['p50']:7.2f} ms  p99 {p['p99']:7.2f} ms  "
        f"mean {p['mean']:7.2f} ms  {len(samples) / seconds:8.0f} ops/s"
    )


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_of(pid: int) -> tuple[str, float] | None:
    """(name, CPU seconds of the process and its waited-for children)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    ticks = sum(int(f) for f in fields[11:15])  # utime stime cutime cstime
    args = [a.decode(errors="replace") for a in cmdline if a]
    if "-m" in args[:-1]:
        name = args[args.index("-m") + 1].removeprefix("services.")
    elif args and Path(args[0]).name.startswith("python") and any(not a.startswith("-") for a in args[1:]):
        # a script, after the interpreter's options: the proxy's sbx-proxy, the spawner's spawnd.py
        name = Path(next(a for a in args[1:] if not a.startswith("-"))).name
    else:
        name = Path(args[0]).name if args else "?"
    return name, ticks / CLOCK_TICKS


def process_tree_cpu(root: int) -> dict[str, float]:
    """CPU seconds so far of ``root`` and every descendant, summed by name (services by
    their module, e.g. ``gateway``; sandboxes and helpers by their program). A process
    that exited and was waited for is in its parent's figure."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    totals: dict[str, float] = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        found = _cpu_of(pid)
        if found is not None:
            totals[found[0]] = totals.get(found[0], 0.0) + found[1]
    return totals


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What each name used between two ``process_tree_cpu`` readings (names that appeared
    since count from zero; ones that vanished are left out)."""
    return {
        name: after[name] - before.get(name, 0.0) for name in after if after[name] > before.get(name, 0.0)
    }
