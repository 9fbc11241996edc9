"""Helpers shared by the benchmarks: a private nats-server and percentile printing."""

from __future__ import annotations

import contextlib
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
