"""Pulled images of the local runtime: pulls on threads of their own, what is here and who
uses it, and pruning what nobody uses.

An image is in use while a sandbox here (or one being made) or a snapshot (its forks run
it) is pinned to its digest; a prune never takes one in use, and a sandbox made just as a
prune ran pulls its image again (``repull_if_pruned``).
"""

from __future__ import annotations

import asyncio
import builtins
import concurrent.futures
import functools
import time
from datetime import UTC, datetime

from shared.contract import references
from shared.runtime import api
from shared.runtime.local import images, layers, sandboxdirs, snapstore

PULL_THREADS = 4
"""Image pulls one runtime runs at once (each downloads up to four layers at a time)."""


class ImagePulls:
    """The images of ``store`` that sandboxes in ``dirs`` and snapshots in ``snapshots`` run."""

    def __init__(
        self,
        store: images.ImageStore,
        dirs: sandboxdirs.SandboxDirs,
        snapshots: snapstore.SnapshotStore,
    ) -> None:
        self.store = store
        self.dirs = dirs
        self.snapshots = snapshots
        # Pulls wait on registries: threads of their own, so that slow ones never take the
        # default executor's (every other blocking call of the service uses those).
        self._threads = concurrent.futures.ThreadPoolExecutor(PULL_THREADS, thread_name_prefix="sbx-pull")

    def reference(self, image: str) -> references.Reference | None:
        """The registry reference ``image`` is, or None for ``default`` or a registered name."""
        if image == images.DEFAULT or self.store.registered(image) is not None:
            return None
        return references.parse(image)

    def present(self, image: str) -> bool:
        ref = self.reference(image)  # (small files read: not worth a thread, which mkfs may hold)
        return ref is None or self.store.pulled.cached(ref) is not None

    async def pull(
        self, image: str, *, refresh: bool = False, progress: layers.Progress | None = None
    ) -> api.PulledImage | None:
        ref = self.reference(image)
        if ref is None:
            return None
        started = time.monotonic()
        pull = functools.partial(self.store.pulled.pull, ref, refresh=refresh, progress=progress)
        pulled = await asyncio.get_running_loop().run_in_executor(self._threads, pull)
        return api.PulledImage(
            reference=str(ref),
            digest=pulled.digest,
            size=pulled.size,
            layers=len(pulled.layers),
            fetched=pulled.fetched,
            downloaded=pulled.downloaded,
            seconds=time.monotonic() - started,
        )

    def in_use(self) -> set[str]:
        """Digests of the pulled images some sandbox here (or one being made), or some
        snapshot (its forks need it), is pinned to."""
        pinned = {s.image_digest for s in self.snapshots.all() if s.image_digest}
        return set(self.dirs.image_users()) | pinned

    def report(self) -> builtins.list[dict[str, object]]:
        """Every image here: built in, registered, and pulled (with its digest, sizes, when
        a sandbox last used it and how many sandboxes use it now)."""
        rows: builtins.list[dict[str, object]] = [{"reference": images.DEFAULT, "kind": "built-in"}]
        rows += [{"reference": name, "kind": "registered"} for name in self.store.names()]
        users, store = self.dirs.image_users(), self.store.pulled
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

    def prune(self, keep_bytes: int = 0) -> tuple[builtins.list[str], int]:
        """Remove pulled images no sandbox uses (see ``LayerStore.prune``): what was
        removed (``reference@digest``) and the bytes freed."""
        removed, freed = self.store.pulled.prune(self.in_use, keep_bytes)
        return [f"{image.reference}@{image.digest}" for image in removed], freed

    def repull_if_pruned(self, image: str, digest: str) -> None:
        """A sandbox just pinned to ``digest``: pull it again if a prune took it meanwhile."""
        with self.store.pulled.using():  # waits for a prune under way to finish
            if self.store.pulled.get(digest) is not None:
                self.store.pulled.touch(self.store.pulled.get(digest))  # type: ignore[arg-type]
                return
        self.store.pulled.pull(references.parse(image).at(digest))
