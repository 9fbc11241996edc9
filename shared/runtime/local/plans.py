"""What bubblewrap is to do for a local sandbox (``bwrap.Plan``): its image's layers and
its own writable places stacked, over a snapshot's layers where it has some, its
environment, the proxy's CA files and its package cache; and the directories a start binds,
made before it starts."""

from __future__ import annotations

import os
from pathlib import Path

from sbx_api import errors
from shared.runtime import api
from shared.runtime.local import bwrap, caches, disk, egresslinks, images, records, snapshots

TOP_DIRS = ("/root", "/home", "/var", "/opt", "/srv")
"""Top-level directories a writable sandbox of an image without a root layer keeps on disk."""
LOWERDIR_MAX = 3800
"""How long the overlay's list of lower directories may be (the kernel takes one page of
mount options; bwrap adds the rest)."""


def writable_dirs(image: images.Image, rw: Path, writable_root: bool) -> tuple[tuple[Path, str], ...]:
    """An image without a root layer (``default``) has only some directories from
    layers; its top-level ``TOP_DIRS`` come from the sandbox's disk when its root is
    writable, so what is written there persists and counts against its disk limit
    (bwrap's own root is a tmpfs in memory)."""
    if not writable_root or any(layer.dest == "/" for layer in image.layers):
        return ()
    taken = {layer.dest for layer in image.layers} | {link for _, link in image.symlinks}
    return tuple((rw / "dirs" / top.strip("/"), top) for top in TOP_DIRS if top not in taken)


class Plans:
    """The plans of sandboxes under ``state_dir``, run by the bubblewrap at ``bwrap_path``."""

    def __init__(
        self,
        state_dir: Path,
        bwrap_path: str,
        slots: caches.Caches,
        links: egresslinks.EgressLinks,
        forks: snapshots.LayerSnapshots,
    ) -> None:
        self.state_dir = state_dir
        self.bwrap = bwrap_path
        self.caches = slots
        self.egress_links = links
        self.snapshots = forks
        # What this kernel has of the /proc entries bwrap covers (it cannot cover the rest).
        self.proc_read_only = tuple(p for p in bwrap.PROC_READ_ONLY if os.path.exists(p))
        self.proc_masked = tuple(p for p in bwrap.PROC_MASKED if os.path.exists(p))

    def env(self, pin: records.Pin | None = None) -> dict[str, str]:
        """What every process in the sandbox gets besides PATH/HOME/TERM/LANG: the image's
        own ``Env`` (its ``PATH`` too), then ours, which no image can change."""
        env = dict(pin.env) if pin is not None else {}
        if pin is not None and pin.workdir:
            env["SBX_WORKDIR"] = pin.workdir  # where the shell starts (the image's WorkingDir)
        env |= {"GIT_TERMINAL_PROMPT": "0", **caches.ENV}  # git: an expired credential fails, never hangs
        return env | self.egress_links.env()

    def plan(
        self, spec: api.SandboxSpec, d: Path, pin: records.Pin, image: images.Image, rw: Path | None = None
    ) -> bwrap.Plan:
        """What bwrap is to do; its writable places on ``rw`` (default: where its bwrap
        finds them, ``Disk.root``)."""
        rw = disk.Disk.root(d) if rw is None else rw
        writable = writable_dirs(image, rw, spec.writable_root)
        inside = {dest for _, dest in writable}
        lowers = self.snapshots.lowers(d, len(image.layers), writable)
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
            env=self.env(pin),
            files=self.egress_links.ca_files(image),
            cache=self.caches.slot(d.name),
            cache_dir=caches.CACHE_DIR,
            tmp_bytes=bwrap.tmp_bytes(spec.limits.memory_bytes),
            proc_read_only=self.proc_read_only,
            proc_masked=self.proc_masked,
            lowers=lowers,
        )

    def prepare(
        self, spec: api.SandboxSpec, d: Path, pin: records.Pin, image: images.Image, at: Path
    ) -> None:
        """The directories a start binds, made on the sandbox's writable directories,
        which this process reaches at ``at`` (``Disk.open``)."""
        plan = self.plan(spec, d, pin, image, rw=at)
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
