"""Snapshots of local sandboxes: a sandbox's writable files copied, at one instant, into a
layer of the snapshot store (``snapstore.py``), and sandboxes started from those layers.

A running sandbox is frozen only for the copy's last pass (``_copy_frozen``); hashing and
storing come after the thaw. A sandbox from a snapshot records what it stands on
(``base.json``) and shows the snapshot's layers read-only below its own writes.
"""

from __future__ import annotations

import asyncio
import builtins
import shutil
import time
from datetime import UTC, datetime
from pathlib import Path

import msgspec

from sbx_api import errors
from shared.contract import ids
from shared.runtime import api
from shared.runtime.local import cgroups, disk, fdtree, freezer, records, sandboxdirs, snapstore

SNAPSHOTS_AT_ONCE = 2
"""Snapshots one runtime copies at once (each walks a tree by descriptor, two per level)."""


def fork_differences(spec: api.SandboxSpec, snapshot: api.SnapshotInfo) -> builtins.list[str]:
    """What a sandbox to start from ``snapshot`` asks differently from it (it may not)."""
    return [
        f"{name} {theirs!r}"
        for name, ours, theirs in (
            ("image", spec.image, snapshot.image),
            ("run_as_root", spec.run_as_root, snapshot.run_as_root),
            ("writable_root", spec.writable_root, snapshot.writable_root),
        )
        if ours != theirs
    ]


def sources(rw: Path) -> builtins.list[tuple[Path, str]]:
    """What a snapshot copies, and where in its layer: ``workspace``, ``root/<n>``,
    ``dirs/<top>`` (the sandbox's trees: read by descriptor, ``fdtree``)."""
    found = [(rw / "workspace", "workspace")]
    for place, folder in (("root", rw / "upper" / "upper"), ("dirs", rw / "dirs")):
        if folder.is_dir():
            found += [(sub, f"{place}/{sub.name}") for sub in sorted(folder.iterdir()) if sub.is_dir()]
    return found


class LayerSnapshots:
    """The snapshots of the sandboxes in ``dirs``, kept in ``store``."""

    def __init__(
        self,
        store: snapstore.SnapshotStore,
        dirs: sandboxdirs.SandboxDirs,
        freezes: freezer.Freezer,
        host_cgroups: cgroups.HostCgroups,
        space: disk.Disk,
    ) -> None:
        self.store = store
        self.dirs = dirs
        self.freezer = freezes
        self.host_cgroups = host_cgroups
        self.disk = space
        self._copying = asyncio.Semaphore(SNAPSHOTS_AT_ONCE)

    async def take(self, sandbox_id: str, snapshot_id: str) -> api.SnapshotInfo:
        """Copy the sandbox's writable files (``/workspace``, its copy-on-write root, the
        shell's saved directory and exports) into a layer of the snapshot store: a running
        sandbox is frozen for the copy and thawed after; hashing and storing come after the
        thaw. See ``snapstore.py``."""
        ids.validate_session_id(snapshot_id, what="snapshot id")
        existing = self.store.get(snapshot_id)
        if existing is not None:
            if existing.sandbox_id != sandbox_id:
                raise errors.Conflict(f"snapshot id {snapshot_id!r} is taken by another sandbox")
            return existing
        info = self.dirs.require(sandbox_id)
        base = records.base_of(self.dirs.dir(sandbox_id))
        if len(base.layers) >= snapstore.MAX_LAYERS:
            raise errors.LimitExceeded(
                f"sandbox {sandbox_id!r} stands on {len(base.layers)} snapshot layers, the most there can "
                "be: snapshot a session forked from an earlier snapshot instead"
            )
        async with self._copying:  # (each holds a thread and descriptors for the copy)
            return await asyncio.to_thread(self._take, info, base, snapshot_id)

    def _take(self, info: api.SandboxInfo, base: records.Base, snapshot_id: str) -> api.SnapshotInfo:
        d, store = self.dirs.dir(info.sandbox_id), self.store
        with disk.Disk.opened(d) as rw:  # (the running sandbox's own filesystem, if it runs)
            trees = sources(rw)
            needs = [fdtree.measure(source) for source, _ in trees]
            size, entries = sum(n.bytes for n in needs), sum(n.entries for n in needs)
            with store.reserving(size) as may_write:
                if problem := self.disk.space_problem(store.root, size=size, entries=entries):
                    raise errors.LimitExceeded(f"no room for this snapshot: {problem}")
                refusal = "the snapshot was stopped: {}".format
                room = disk.Headroom(store.root, self.disk, refusal, may_write)
                copy = store.new_copy()
                try:
                    frozen = self._copy_frozen(info, rw, trees, copy, room)
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

    def _copy_frozen(
        self,
        info: api.SandboxInfo,
        rw: Path,
        trees: builtins.list[tuple[Path, str]],
        copy: Path,
        room: disk.Headroom,
    ) -> float:
        """Copy ``trees`` into ``copy`` as they are at one instant: everything is copied
        as it is (the sandbox may run meanwhile, each entry noted as it is looked at),
        then, with the sandbox's freezer held (``Freezer.lock``: no pause or resume
        meanwhile), what changed since is copied again (a walk, plus the changes) while
        its processes are frozen, with the shell's saved directory and exports: frozen
        now and thawed after if it runs, left as they are if it is paused or stopped.
        Every read is by descriptor (``fdtree``), frozen or not, and every write goes
        through ``room`` (the store's budget, the filesystem's reserve). How long it was
        frozen for this (0: it was not running)."""
        pairs = [(source, copy / where) for source, where in trees]
        started_ns = time.time_ns()
        first = {str(dest): fdtree.sync(source, dest, guard=room) for source, dest in pairs}
        d, name = self.dirs.dir(info.sandbox_id), sandboxdirs.cgroup_name(info.sandbox_id)
        with self.freezer.lock(d):
            freeze = (
                self.host_cgroups.can_freeze and self.dirs.running(d) is not None and not self.dirs.frozen(d)
            )
            started = time.monotonic()
            if freeze:
                self.host_cgroups.get().freeze(name)
            try:
                for source, dest in pairs:
                    before = first[str(dest)].notes
                    recent_ns = started_ns - fdtree.CTIME_SLACK_NS
                    fdtree.sync(source, dest, before=before, recent_ns=recent_ns, guard=room)
                for shell_file in snapstore.SHELL_FILES:  # (small: copied at the instant itself)
                    snapstore.copy_shell_file(rw / "control", shell_file, copy / "shell" / shell_file)
                snapstore.settle(copy)
            finally:
                if freeze:
                    self.host_cgroups.get().thaw(name)
            return time.monotonic() - started if freeze else 0.0

    def get(self, snapshot_id: str) -> api.SnapshotInfo | None:
        return self.store.get(snapshot_id)

    def list(self) -> builtins.list[api.SnapshotInfo]:
        return self.store.all()

    async def delete(self, snapshot_id: str) -> bool:
        """Forget it; its layers go once no other snapshot and no sandbox uses them."""
        forgotten = self.store.forget(snapshot_id)
        if forgotten:
            await asyncio.to_thread(self.collect_layers)
        return forgotten

    def bytes(self) -> int:
        return self.store.bytes()

    def collect_layers(self) -> int:
        return self.store.collect(self.dirs.layers_in_use)

    def fork_of(self, spec: api.SandboxSpec) -> api.SnapshotInfo | None:
        """The snapshot a sandbox is to start from (checked against the spec), or None."""
        if spec.snapshot is None:
            return None
        snapshot = self.store.get(spec.snapshot)
        if snapshot is None:
            raise errors.NotFound(f"snapshot {spec.snapshot!r} does not exist")
        if differs := fork_differences(spec, snapshot):
            raise errors.InvalidInput(
                f"a sandbox from snapshot {spec.snapshot!r} has its snapshot's {', '.join(differs)}"
            )
        return snapshot

    def write_base(self, d: Path, rw: Path, snapshot: api.SnapshotInfo) -> None:
        """The snapshot's layers (they stay while this sandbox is), and its shell's saved
        directory and exports, where the sandbox's shell reads them when it starts. Named
        while the store is held, its record read again: a deletion meanwhile is said so,
        and a collection cannot take the layers in between."""
        with self.store.locked():
            if self.store.get(snapshot.snapshot_id) is None:
                raise errors.NotFound(f"snapshot {snapshot.snapshot_id!r} does not exist (deleted just now)")
            (d / "base.json").write_bytes(
                msgspec.json.encode(records.Base(snapshot.snapshot_id, snapshot.layers))
            )
        shell = self.store.layer(snapshot.layers[-1]) / "shell"
        if shell.is_dir():
            fdtree.sync(shell, rw / "control" / "shell")

    def lowers(
        self, d: Path, image_layers: int, writable: tuple[tuple[Path, str], ...]
    ) -> dict[str, tuple[Path, ...]]:
        """A sandbox from a snapshot: each writable place's read-only directories from the
        snapshot's layers (those there are), bottom first."""
        base = records.base_of(d)
        if not base.layers:
            return {}
        places = ["workspace", *(f"root/{n}" for n in range(image_layers))]
        places += [f"dirs/{source.name}" for source, _ in writable]
        layer_dirs = [self.store.layer(digest) for digest in base.layers]
        found = {
            place: tuple(p for p in (top / place for top in layer_dirs) if p.is_dir()) for place in places
        }
        return {place: dirs for place, dirs in found.items() if dirs}
