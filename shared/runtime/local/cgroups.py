"""Resource limits through cgroups, on the v1 hierarchy (per-controller mounts, what the
build machines have) or the v2 unified hierarchy, whichever offers the controllers.

Each sandbox gets a group named ``sbx-<token>`` under a parent ``sbx``; processes join
it by writing their pid to the group's ``cgroup.procs`` (in every controller on v1).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from shared.contract import errors
from shared.runtime import api

ROOT = Path("/sys/fs/cgroup")
PARENT = "sbx"
V1_CONTROLLERS = ("memory", "cpu", "pids")
CPU_PERIOD_US = 100_000


@dataclass(frozen=True)
class Cgroups:
    """A cgroup driver: ``version`` 1 or 2, rooted at ``root`` (a test may point it elsewhere)."""

    version: int
    root: Path = ROOT

    @classmethod
    def detect(cls, root: Path = ROOT) -> Cgroups:
        if all((root / c / "cgroup.procs").exists() for c in V1_CONTROLLERS):
            return cls(1, root)
        controllers = root / "cgroup.controllers"
        if controllers.exists() and {"memory", "cpu", "pids"} <= set(controllers.read_text().split()):
            return cls(2, root)
        raise errors.ConfigError(
            "no usable cgroup hierarchy: resource limits need the memory, cpu and pids controllers "
            "(cgroup v1 mounts under /sys/fs/cgroup/<controller> or v2 with them enabled) and root"
        )

    def dirs(self, name: str) -> list[Path]:
        if self.version == 1:
            return [self.root / c / PARENT / name for c in V1_CONTROLLERS]
        return [self.root / PARENT / name]

    def create(self, name: str, limits: api.Limits) -> None:
        try:
            if self.version == 2:
                parent = self.root / PARENT
                parent.mkdir(exist_ok=True)
                _write(self.root / "cgroup.subtree_control", "+memory +cpu +pids")
                _write(parent / "cgroup.subtree_control", "+memory +cpu +pids")
            for d in self.dirs(name):
                d.mkdir(parents=True, exist_ok=True)
            quota = max(1000, int(limits.cpus * CPU_PERIOD_US))
            if self.version == 1:
                mem, cpu, pids = self.dirs(name)
                _write(mem / "memory.limit_in_bytes", str(limits.memory_bytes))
                if (mem / "memory.memsw.limit_in_bytes").exists():
                    _write(mem / "memory.memsw.limit_in_bytes", str(limits.memory_bytes))
                _write(cpu / "cpu.cfs_period_us", str(CPU_PERIOD_US))
                _write(cpu / "cpu.cfs_quota_us", str(quota))
                _write(pids / "pids.max", str(limits.pids))
            else:
                (d,) = self.dirs(name)
                _write(d / "memory.max", str(limits.memory_bytes))
                if (d / "memory.swap.max").exists():
                    _write(d / "memory.swap.max", "0")
                _write(d / "cpu.max", f"{quota} {CPU_PERIOD_US}")
                _write(d / "pids.max", str(limits.pids))
        except OSError as exc:
            raise errors.InfrastructureError(f"cannot set up cgroup {name}: {exc}") from exc

    def join(self, name: str, pid: int) -> None:
        """Move ``pid`` into the group (call in a child before exec, with its own pid)."""
        for d in self.dirs(name):
            _write(d / "cgroup.procs", str(pid))

    def pids(self, name: str) -> list[int]:
        try:
            text = (self.dirs(name)[0] / "cgroup.procs").read_text()
        except FileNotFoundError:
            return []
        return [int(p) for p in text.split()]

    def kill_all(self, name: str, timeout: float = 5.0) -> None:
        """SIGKILL every process in the group until it is empty."""
        deadline = time.monotonic() + timeout
        while pids := self.pids(name):
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if time.monotonic() > deadline:
                raise errors.InfrastructureError(f"cgroup {name} still has processes {pids[:5]}")
            time.sleep(0.01)

    def remove(self, name: str) -> None:
        self.kill_all(name)
        for d in self.dirs(name):
            for _ in range(100):
                try:
                    d.rmdir()
                except FileNotFoundError:  # gone already (a stopped sandbox): nothing to wait for
                    break
                except OSError:  # busy for a moment after the last process exits
                    time.sleep(0.01)
                    continue
                break


def _write(path: Path, value: str) -> None:
    with open(path, "w") as handle:
        handle.write(value)
