"""Facts about processes on this machine, read from /proc: a process's start time (which
tells a reused pid apart) and the kernel and pid namespace this process runs in."""

from __future__ import annotations

import functools
import os
from pathlib import Path


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks after boot; None if there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


@functools.cache
def place() -> str:
    """This process's kernel (boot id) and pid namespace: pids mean the same only within it."""
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
