"""Resource limits through cgroups, on the v1 hierarchy (per-controller mounts, what the
build machines have) or the v2 unified hierarchy, whichever offers the controllers.

Each sandbox gets a group named ``sbx-<token>`` under a parent ``sbx``; processes join
it by writing their pid to the group's ``cgroup.procs`` (in every controller on v1).
Where the freezer is there (v1: a ``freezer`` mount; v2: ``cgroup.freeze``), a group can
be frozen whole (a paused sandbox: every process stopped where it is, memory kept, no
CPU time) and thawed again.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from sbx_api import errors
from shared.runtime import api

ROOT = Path("/sys/fs/cgroup")
PARENT = "sbx"
V1_CONTROLLERS = ("memory", "cpu", "pids")
V1_FREEZER = "freezer"
V1_CPUACCT = "cpuacct"
"""v1's CPU time accounting, where it is a mount of its own (when it is mounted with
``cpu``, the cpu group already counts): what :meth:`Cgroups.usage` reads."""
CPU_PERIOD_US = 100_000
FREEZE_RETRY = 0.1
"""A freeze not settled after this long is thawed for a moment and tried again."""
FREEZE_TIMEOUT = 5.0
"""How long a freeze may take (a process in uninterruptible sleep delays it) before the
group is thawed again and the pause refused."""


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

    @functools.cached_property
    def can_freeze(self) -> bool:
        """Whether groups can be frozen here."""
        if self.version == 1:
            return (self.root / V1_FREEZER / "cgroup.procs").exists()
        return (self.root / "cgroup.controllers").exists()  # every v2 group has cgroup.freeze (5.2+)

    @functools.cached_property
    def separate_cpuacct(self) -> bool:
        """v1: whether ``cpuacct`` is a hierarchy apart from ``cpu`` (a group joins it too,
        so its CPU time is counted); False where they are mounted together, or on v2."""
        if self.version != 1 or not (self.root / V1_CPUACCT / "cpuacct.usage").exists():
            return False
        return (self.root / V1_CPUACCT).resolve() != (self.root / "cpu").resolve()

    def dirs(self, name: str) -> list[Path]:
        """The group's directories: memory, cpu, pids (v1), then the freezer's and the
        separate cpuacct's if any."""
        if self.version == 1:
            controllers = (*V1_CONTROLLERS, V1_FREEZER) if self.can_freeze else V1_CONTROLLERS
            if self.separate_cpuacct:
                controllers = (*controllers, V1_CPUACCT)
            return [self.root / c / PARENT / name for c in controllers]
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
                mem, cpu, pids = self.dirs(name)[:3]
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

    def procs_files(self, name: str) -> list[str]:
        """What a process writes ``0`` to, to join the group itself (the launcher does)."""
        return [str(d / "cgroup.procs") for d in self.dirs(name)]

    def join(self, name: str, pid: int) -> None:
        """Move ``pid`` into the group (call in a child before exec, with its own pid). A
        group made before this version counted CPU time has no cpuacct directory: the
        process is accounted as its sandbox's other processes are, not at all."""
        for d in self.dirs(name):
            try:
                _write(d / "cgroup.procs", str(pid))
            except FileNotFoundError:
                if d.parent.parent.name != V1_CPUACCT:
                    raise

    def usage(self, name: str) -> Usage:
        """What the group uses now, as the kernel counts it (files of the host's cgroup
        tree, which nothing in a sandbox can write). Raises NotFound if the group is gone."""
        try:
            if self.version == 1:
                mem, cpu = self.dirs(name)[:2]
                acct = self.root / V1_CPUACCT / PARENT / name if self.separate_cpuacct else cpu
                cpu_ns = int((acct / "cpuacct.usage").read_text())
                stat = _stat(mem / "memory.stat")
                return Usage(
                    cpu_ns=cpu_ns,
                    memory=int((mem / "memory.usage_in_bytes").read_text()),
                    cache=stat.get("total_cache", stat.get("cache", 0)),
                )
            (d,) = self.dirs(name)
            return Usage(
                cpu_ns=_stat(d / "cpu.stat").get("usage_usec", 0) * 1000,
                memory=int((d / "memory.current").read_text()),
                cache=_stat(d / "memory.stat").get("file", 0),
            )
        except FileNotFoundError:
            raise errors.NotFound(f"cgroup {name} does not exist (the sandbox is not running)") from None
        except (OSError, ValueError) as exc:
            raise errors.InfrastructureError(f"cannot read the use of cgroup {name}: {exc}") from exc

    def pids(self, name: str) -> list[int]:
        try:
            text = (self.dirs(name)[0] / "cgroup.procs").read_text()
        except FileNotFoundError:
            return []
        return [int(p) for p in text.split()]

    def kill_all(self, name: str, timeout: float = 5.0) -> None:
        """SIGKILL every process in the group until it is empty (a frozen group is thawed
        once they are signalled: they die as they wake, running nothing more)."""
        deadline = time.monotonic() + timeout
        while pids := self.pids(name):
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if self.frozen(name):
                self.thaw(name)
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

    # ---- freezer -----------------------------------------------------------------------

    def _freezer(self, name: str) -> Path:
        return self.root / V1_FREEZER / PARENT / name if self.version == 1 else self.root / PARENT / name

    def frozen(self, name: str) -> bool:
        """Whether the group is frozen or being frozen (False where there is no freezer)."""
        if not self.can_freeze:
            return False
        try:
            if self.version == 1:
                return (self._freezer(name) / "freezer.state").read_text().strip() != "THAWED"
            return (self._freezer(name) / "cgroup.freeze").read_text().strip() == "1"
        except OSError:
            return False

    def _settled(self, name: str) -> bool:
        if self.version == 1:
            return (self._freezer(name) / "freezer.state").read_text().strip() == "FROZEN"
        return "frozen 1" in (self._freezer(name) / "cgroup.events").read_text().splitlines()

    def _adopt(self, name: str) -> bool:
        """Move into the freezer group any process of the group that is not in it (one
        started before the sandbox's processes joined the freezer); True if none was missing."""
        if self.version == 2:
            return True
        inside = set(self.pids_in(self._freezer(name)))
        missing = [pid for pid in self.pids(name) if pid not in inside]
        for pid in missing:
            with contextlib.suppress(OSError):  # (gone meanwhile)
                _write(self._freezer(name) / "cgroup.procs", str(pid))
        return not missing

    @staticmethod
    def pids_in(directory: Path) -> list[int]:
        try:
            return [int(p) for p in (directory / "cgroup.procs").read_text().split()]
        except FileNotFoundError:
            return []

    def freeze(self, name: str, timeout: float = FREEZE_TIMEOUT) -> None:
        """Freeze every process of the group; returns once all are frozen. Raises NotBuiltYet
        where there is no freezer, InfrastructureError (the group thawed again) when the
        freeze does not settle in ``timeout``."""
        if not self.can_freeze:
            raise errors.NotBuiltYet("this machine has no cgroup freezer: sandboxes cannot be paused here")
        directory = self._freezer(name)
        state = directory / ("freezer.state" if self.version == 1 else "cgroup.freeze")
        frozen, thawed = ("FROZEN", "THAWED") if self.version == 1 else ("1", "0")
        try:
            directory.mkdir(parents=True, exist_ok=True)
            self._adopt(name)
            _write(state, frozen)
            now = time.monotonic()
            deadline, retry_at = now + timeout, now + FREEZE_RETRY
            delay = 0.0002
            # A process forked while the others were moved may have escaped: moved into a
            # frozen group, it freezes too.
            while not (self._settled(name) and self._adopt(name)):
                now = time.monotonic()
                if now > deadline:
                    self.thaw(name)
                    raise errors.InfrastructureError(f"cgroup {name} did not freeze within {timeout:g} s")
                if now > retry_at:
                    # Stuck: a vfork parent waits, unfreezable, for a child frozen before its
                    # exec (v1 stays FREEZING for ever; seen here about once in 400 freezes
                    # of a shell loop). Thawed for a moment, the child execs; then again.
                    _write(state, thawed)
                    time.sleep(0.001)
                    _write(state, frozen)
                    retry_at, delay = now + FREEZE_RETRY, 0.0002
                time.sleep(delay)
                delay = min(delay * 2, 0.01)
        except OSError as exc:
            with contextlib.suppress(OSError):
                self.thaw(name)
            raise errors.InfrastructureError(f"cannot freeze cgroup {name}: {exc}") from exc

    def thaw(self, name: str) -> None:
        """Let every process of the group run again (nothing to do if it is not frozen)."""
        directory = self._freezer(name)
        if not self.can_freeze or not directory.exists():
            return
        try:
            _write(directory / ("freezer.state" if self.version == 1 else "cgroup.freeze"),
                   "THAWED" if self.version == 1 else "0")  # fmt: skip
        except OSError as exc:
            raise errors.InfrastructureError(f"cannot thaw cgroup {name}: {exc}") from exc


@dataclass(frozen=True)
class Usage:
    """A group's use at one moment (:meth:`Cgroups.usage`)."""

    cpu_ns: int
    """CPU time its processes used, all of them since the group was made."""
    memory: int
    """Bytes of memory charged to it now, page cache included."""
    cache: int
    """Of which page cache."""


def _stat(path: Path) -> dict[str, int]:
    """A ``key value`` file (memory.stat, cpu.stat) as numbers; other lines skipped."""
    out: dict[str, int] = {}
    for line in path.read_text().splitlines()[:200]:
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            out[key] = int(value)
    return out


class HostCgroups:
    """This host's cgroup driver, or why there is none: a runtime without one still starts
    (its service runs and says why), and each use that needs one raises the reason."""

    def __init__(self, given: Cgroups | None = None) -> None:
        self.driver = given
        self.error: errors.ConfigError | None = None
        if given is None:
            try:
                self.driver = Cgroups.detect()
            except errors.ConfigError as exc:
                self.error = exc

    def get(self) -> Cgroups:
        if self.driver is None:
            assert self.error is not None
            raise self.error
        return self.driver

    @property
    def can_freeze(self) -> bool:
        return self.driver is not None and self.driver.can_freeze

    def frozen(self, name: str) -> bool:
        """Whether the group is frozen or being frozen (False without a driver)."""
        return self.driver is not None and self.driver.frozen(name)


def _write(path: Path, value: str) -> None:
    with open(path, "w") as handle:
        handle.write(value)


# ---- moving processes between groups: the host's cgroup2 ``favordynmods`` --------------------

FAVOR_DYNMODS = "favordynmods"
MOUNTINFO = Path("/proc/self/mountinfo")
FEATURES = Path("/sys/kernel/cgroup/features")
_VFS_ONLY = {"rw", "ro"}


def dynmods_remount(mountinfo: str, features: str) -> tuple[list[str] | None, str]:
    """The ``mount`` command that turns on cgroup2's ``favordynmods`` (the mount's flags and
    the hierarchy's other options kept), or None, and what it is about. Pure.

    Every process that enters a sandbox (a command, the shell helper, the sandbox's own
    start) joins its group; without the option, the first such move after a quiet moment
    waits for an RCU grace period (7.5-15 ms on the build machines, cgroup v1 included: the
    lock is the kernel's, shared by every hierarchy); with it, 0.2 ms. The kernel's
    documented price: forks and exits take a little longer (within noise here)."""
    if FAVOR_DYNMODS not in features.split():
        return (
            None,
            "this kernel has no favordynmods (before 6.0): cgroup moves stay slow after a quiet moment",
        )
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        after = line.split(" - ", 1)[1].split()
        if len(after) < 3 or after[0] != "cgroup2":
            continue
        options = [o for o in after[2].split(",") if o and o not in _VFS_ONLY]
        if FAVOR_DYNMODS in options:
            return None, "favordynmods on already"
        # Both the mount's own flags (nosuid, nodev, noexec, ...) and the hierarchy's
        # options, said again: mount(8) given a source and a target uses only these.
        wanted = ",".join(["remount", *fields[5].split(","), *options, FAVOR_DYNMODS])
        return [
            "mount",
            "-t",
            "cgroup2",
            "-o",
            wanted,
            "cgroup2",
            fields[4],
        ], f"favordynmods turned on at {fields[4]}"
    return None, "no cgroup2 mount here: cgroup moves stay slow after a quiet moment"


def favor_dynamic_moves(mountinfo: Path = MOUNTINFO, features: Path = FEATURES) -> str:
    """Turn on ``favordynmods`` for this host's cgroups where it is off (see
    :func:`dynmods_remount`); what was done, or why not. Needs root in the host's
    namespaces; a refusal is said, not raised (sandboxes work either way)."""
    try:
        argv, about = dynmods_remount(
            mountinfo.read_text(), features.read_text() if features.exists() else ""
        )
    except OSError as exc:
        return f"cgroup moves not tuned: {exc}"
    if argv is None:
        return about
    done = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
    if done.returncode != 0:
        return f"favordynmods not turned on ({' '.join(argv)}): {done.stderr.strip()[:200]}"
    return about
