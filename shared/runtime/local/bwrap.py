"""Building the bubblewrap command line for one sandbox: a pure function of a plan.

Kept pure so that every isolation decision is visible in one place and unit-tested
field by field; ``runtime.py`` only runs what this returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from shared.runtime import api

SANDBOX_UID = 1000
SANDBOX_USER = "sandbox"
WORKSPACE = "/workspace"
CONTROL = "/.sbx"
"""Inside path of the sandbox's control directory (shell state, job files)."""
HOLD = "/.sbx-hold"
"""A FIFO nobody writes: the sandbox's main process blocks reading it, using only a
shell builtin, so any image with /bin/sh can be held open."""
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
TMP_BYTES = 1024**3
OUTPUT_DIR, OUTPUT_BYTES = api.OUTPUT_DIR, api.OUTPUT_BYTES
ROOT_CAPS = {
    "CAP_CHOWN": 0, "CAP_DAC_OVERRIDE": 1, "CAP_FOWNER": 3, "CAP_FSETID": 4, "CAP_KILL": 5,
    "CAP_SETGID": 6, "CAP_SETUID": 7, "CAP_SETPCAP": 8, "CAP_NET_BIND_SERVICE": 10,
    "CAP_SYS_CHROOT": 18, "CAP_SETFCAP": 31,
}  # fmt: skip
"""What root inside keeps (of its own user namespace): what package managers and build
tools use. Not CAP_SYS_ADMIN, CAP_NET_ADMIN (nf_tables, tc), CAP_NET_RAW (AF_PACKET),
CAP_SYS_PTRACE or the rest: Docker's default set, less raw sockets, mknod and audit."""
PROC_READ_ONLY = ("/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus", "/proc/fs")
"""Shown read-only (the host's: bind sources are outside the sandbox; only reads remain)."""
PROC_MASKED = ("/proc/kcore", "/proc/keys", "/proc/timer_list", "/proc/sched_debug", "/proc/latency_stats")
"""Shown as /dev/null (Docker masks the same): kernel memory and host-wide details."""
USERNS_FD = 5
"""The fd of the sandbox's user namespace, when the runtime made one (userns.py)."""
SECCOMP_FD = 4
"""The fd bwrap reads the seccomp program from (see seccomp.py)."""
INFO_FD = 3
"""The fd bwrap writes its child's pid to (closed once written)."""


@dataclass(frozen=True)
class Fds:
    """Where bwrap finds its user namespace and seccomp program and writes its info: the
    launcher passes them at whatever numbers they have (nothing is moved between fork and
    exec), the defaults are the conventional ones."""

    info: int = INFO_FD
    seccomp: int = SECCOMP_FD
    userns: int = USERNS_FD


NOFILE_MIN, NOFILE_MAX = 1024, 65536


def tmp_bytes(memory_bytes: int) -> int:
    """``/tmp``'s size: at most half the memory limit (its pages are memory), so filling
    it gives ENOSPC, never an out-of-memory kill; 1 GiB at most."""
    return min(TMP_BYTES, memory_bytes // 2)


def nofile(pids: int, file_max: int) -> int:
    """RLIMIT_NOFILE for one sandbox's processes: its ``pids`` processes together may hold
    at most an eighth of the host's file table (``fs.file-max``), within [1024, 65536]."""
    return max(NOFILE_MIN, min(NOFILE_MAX, file_max // (8 * max(pids, 1))))


@dataclass(frozen=True)
class Layer:
    """A read-only source directory shown at ``dest`` (copy-on-write when the root is writable)."""

    source: Path
    dest: str
    lower: tuple[Path, ...] = ()
    """More read-only directories below ``source``, bottom first (an image's layers:
    ``source`` is then the image's top directory); all stacked as one overlay."""


@dataclass(frozen=True)
class Plan:
    bwrap: str
    layers: tuple[Layer, ...]
    symlinks: tuple[tuple[str, str], ...]
    """``(target, link)`` pairs, e.g. ``("usr/bin", "/bin")`` on merged-/usr hosts."""
    dirs: tuple[str, ...]
    """Empty directories to create in the sandbox root (e.g. ``/root``)."""
    upper: Path
    """Where copy-on-write changes go (``upper/<n>`` and ``work/<n>`` per layer)."""
    workspace: Path
    control: Path
    hold: Path
    run_as_root: bool
    writable_root: bool
    uid: int = SANDBOX_UID
    """Who it runs as without ``run_as_root`` (the image's ``User``, else the sandbox user)."""
    home: str = f"/home/{SANDBOX_USER}"
    hostname: str = "sandbox"
    env: dict[str, str] = field(default_factory=dict)
    files: tuple[tuple[Path, str], ...] = ()
    """Host files shown read-only at the given inside paths (the proxy's CA certificate)."""
    cache: Path | None = None
    """The sandbox's cache slot, shown at ``cache_dir`` (see ``caches``)."""
    cache_dir: str = "/.sbx/cache"
    writable: tuple[tuple[Path, str], ...] = ()
    """Host directories shown writable at the given inside paths (``/root``, ``/var``...
    of an image whose root is not a layer: on the sandbox's disk, not in memory)."""
    lowers: dict[str, tuple[Path, ...]] = field(default_factory=dict)
    """A sandbox started from a snapshot: the snapshot's read-only directories below each of
    its writable places, bottom first, by place: ``workspace``, ``root/<n>`` (above image
    layer ``n``), ``dirs/<top>``. Each place is then an overlay (work directories under
    ``upper/work``); without them ``/workspace`` and the writable dirs are plain binds."""
    tmp_bytes: int = TMP_BYTES
    """The size of ``/tmp`` (a tmpfs, whose pages count against the memory limit)."""
    proc_read_only: tuple[str, ...] = PROC_READ_ONLY
    proc_masked: tuple[str, ...] = PROC_MASKED
    """Of ``PROC_READ_ONLY`` and ``PROC_MASKED``, those this kernel has (bwrap cannot
    cover a path that does not exist)."""


def home(run_as_root: bool) -> str:
    return "/root" if run_as_root else f"/home/{SANDBOX_USER}"


# Long on purpose: the command line, one flag group after another, as
# tests/unit/test_bwrap_plan.py checks it field by field.
def argv(plan: Plan, main: list[str], fds: Fds | None = None) -> list[str]:
    """The full ``bwrap`` argv that runs ``main`` as the sandbox's main process, with
    what bwrap reads and writes at ``fds`` (the usual numbers by default)."""
    fds = fds or Fds()
    uid = 0 if plan.run_as_root else plan.uid
    args = [
        plan.bwrap,
        # The runtime's user namespace (userns.py), given at USERNS_FD; bwrap makes the
        # others in it: pid, net (no network at all, only lo), ipc, uts, cgroup. Nested
        # user namespaces are refused by the seccomp filter (given at SECCOMP_FD).
        "--userns",
        str(fds.userns),
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup",
        "--uid",
        str(uid),
        "--gid",
        str(uid),
        "--hostname",
        plan.hostname,
        "--new-session",  # no controlling terminal to inject into (TIOCSTI)
        "--info-fd",
        str(fds.info),
        "--clearenv",
    ]
    for index, layer in enumerate(plan.layers):
        sources = [arg for lower in (*layer.lower, layer.source) for arg in ("--overlay-src", str(lower))]
        if plan.writable_root:
            upper = plan.upper / "upper" / str(index)
            work = plan.upper / "work" / str(index)
            sources += _overlay_sources(plan.lowers.get(f"root/{index}", ()))
            args += [*sources, "--overlay", str(upper), str(work), layer.dest]
        elif layer.lower:
            args += [*sources, "--ro-overlay", layer.dest]
        else:
            args += ["--ro-bind", str(layer.source), layer.dest]
    for target, link in plan.symlinks:
        args += ["--symlink", target, link]
    for directory in plan.dirs:
        args += ["--dir", directory]
    for source, dest in plan.writable:
        args += _writable(plan, f"dirs/{source.name}", source, dest)
    args += [
        "--proc",
        "/proc",
        # Sandbox processes are host uid 0 on files: /proc entries owned by root would be
        # writable (core_pattern runs a program as host root; sysrq-trigger crashes the
        # host). bwrap covers some only where it can write them itself; these always.
        *(arg for path in plan.proc_read_only for arg in ("--ro-bind", path, path)),
        *(arg for path in plan.proc_masked for arg in ("--ro-bind", "/dev/null", path)),
        "--dev",
        "/dev",
        "--size",
        str(plan.tmp_bytes),
        "--tmpfs",
        "/tmp",
        "--size",
        str(OUTPUT_BYTES),
        "--perms",
        "1777",
        "--tmpfs",
        OUTPUT_DIR,
        *_writable(plan, "workspace", plan.workspace, WORKSPACE),
        "--bind",
        str(plan.control),
        CONTROL,
        "--ro-bind",
        str(plan.hold),
        HOLD,
        *(arg for source, dest in plan.files for arg in ("--ro-bind", str(source), dest)),
        *(("--bind", str(plan.cache), plan.cache_dir) if plan.cache is not None else ()),
        "--chdir",
        WORKSPACE,
    ]
    args += ["--cap-drop", "ALL"]
    if plan.run_as_root:
        for cap in ROOT_CAPS:
            args += ["--cap-add", cap]
    args += ["--seccomp", str(fds.seccomp)]
    env = {
        "PATH": PATH,
        "HOME": "/root" if plan.run_as_root else plan.home,
        "TERM": "dumb",
        "LANG": "C.UTF-8",
        **plan.env,
    }
    for key, value in sorted(env.items()):
        args += ["--setenv", key, value]
    return [*args, "--", *main]


def _overlay_sources(lowers: tuple[Path, ...]) -> list[str]:
    return [arg for lower in lowers for arg in ("--overlay-src", str(lower))]


def work_dir(plan: Plan, place: str) -> Path:
    """The overlay work directory of a writable place of a sandbox started from a snapshot."""
    return plan.upper / "work" / place.replace("/", "-")


def _writable(plan: Plan, place: str, source: Path, dest: str) -> list[str]:
    """A writable place: a bind of ``source``, or, over a snapshot's directories, an overlay
    whose upper is ``source``."""
    lowers = plan.lowers.get(place, ())
    if not lowers:
        return ["--bind", str(source), dest]
    return [*_overlay_sources(lowers), "--overlay", str(source), str(work_dir(plan, place)), dest]


def hold_main() -> list[str]:
    """The main process: wait forever on the hold FIFO with a shell builtin."""
    return ["/bin/sh", "-c", f"read _ < {HOLD}"]
