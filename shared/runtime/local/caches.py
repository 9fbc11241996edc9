"""Per-tenant package caches on the local runtime.

A sandbox is created before anyone knows whose it will be (warm pool), so its cache is
attached when a session of an organisation first uses it, by mount propagation:

* before the sandbox starts, its *slot* ``<state>/cache-slots/<token>`` (an empty
  directory) is bind-mounted onto itself and made a shared mount; bubblewrap binds it
  at :data:`CACHE_DIR`, a slave of that mount;
* attaching binds ``<state>/caches/<org token>`` onto the slot on the host, and the
  mount propagates into the sandbox, which now sees its organisation's cache.

Sandboxes are never reused across sessions, so a slot carries one organisation's
cache for the sandbox's whole life; attaching another one is refused. A sandbox whose
session has no organisation keeps its empty slot: a cache of its own, deleted with it.

Slots live outside the sandboxes' directories, and deleting a sandbox detaches its
slot's mounts *before* anything is removed (and removes the slot with ``rmdir`` only),
so removing a sandbox can never reach into a cache.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import os
import shutil
from pathlib import Path

from shared import errors

CACHE_DIR = "/.sbx/cache"
"""Where a sandbox sees its cache."""
ENV = {
    "XDG_CACHE_HOME": CACHE_DIR,
    "PIP_CACHE_DIR": f"{CACHE_DIR}/pip",
    "UV_CACHE_DIR": f"{CACHE_DIR}/uv",
    "npm_config_cache": f"{CACHE_DIR}/npm",
    "YARN_CACHE_FOLDER": f"{CACHE_DIR}/yarn",
    "GOMODCACHE": f"{CACHE_DIR}/go-mod",
    "GOCACHE": f"{CACHE_DIR}/go-build",
}
"""Where package tools put their caches (each also honours XDG_CACHE_HOME or its own)."""
MS_BIND = 0x1000
MS_SHARED = 1 << 20
MNT_DETACH = 2
MARKER = ".sbx-cache"

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p)
_libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)


def _mount(source: Path | None, target: Path, flags: int) -> None:
    src = os.fsencode(source) if source is not None else None
    if _libc.mount(src, os.fsencode(target), None, flags, None) != 0:
        code = ctypes.get_errno()
        raise errors.InfrastructureError(f"mount {source} on {target} failed: {os.strerror(code)}")


def mounted_on(target: Path) -> int:
    """How many mounts are stacked on ``target`` (from /proc/self/mountinfo)."""
    wanted = os.fsencode(target)
    count = 0
    with open("/proc/self/mountinfo", "rb") as info:
        for line in info:
            point = line.split(b" ", 5)[4]
            if point == wanted or point.replace(b"\\040", b" ") == wanted:
                count += 1
    return count


class Caches:
    def __init__(self, state_dir: Path) -> None:
        self.slots = state_dir / "cache-slots"
        self.caches = state_dir / "caches"

    def slot(self, token: str) -> Path:
        return self.slots / token

    def prepare(self, token: str) -> Path:
        """The sandbox's slot, a shared mount (idempotent): call before it starts."""
        slot = self.slot(token)
        slot.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(slot, 0o700)  # inside, the sandbox's user maps to the owner (host root)
        if mounted_on(slot) == 0:
            _mount(slot, slot, MS_BIND)
        _mount(None, slot, MS_SHARED)
        return slot

    def attach(self, token: str, key: str) -> bool:
        """Show cache ``key`` in the sandbox's slot; False if it already was. A slot that
        carries another cache refuses (Conflict)."""
        if not key or not all(c in "0123456789abcdef" for c in key):
            raise errors.InvalidInput("a cache key is a hex token")
        slot = self.slot(token)
        if not slot.is_dir() or mounted_on(slot) == 0:
            raise errors.NotRunning("the sandbox has no cache slot (was it started before caches existed?)")
        cache = self.caches / key
        cache.mkdir(parents=True, exist_ok=True)
        os.chmod(cache, 0o700)
        lock_path = self.slots / f".{token}.lock"
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            marker = self.slots / f".{token}.{MARKER}"
            current = marker.read_text().strip() if marker.exists() else ""
            if current == key and mounted_on(slot) >= 2:
                return False
            if current and current != key:
                raise errors.Conflict("this sandbox already shows another organisation's cache")
            _mount(cache, slot, MS_BIND)
            marker.write_text(key + "\n")
            return True
        finally:
            os.close(fd)

    def release(self, token: str) -> None:
        """Detach everything mounted on the slot, then remove what is left of it."""
        slot = self.slot(token)
        for _ in range(8):
            if not slot.exists() or mounted_on(slot) == 0:
                break
            if _libc.umount2(os.fsencode(slot), MNT_DETACH) != 0:
                code = ctypes.get_errno()
                raise errors.InfrastructureError(f"unmounting {slot} failed: {os.strerror(code)}")
        if slot.exists():
            if mounted_on(slot):
                raise errors.InfrastructureError(f"{slot} is still mounted: not removed")
            shutil.rmtree(slot, ignore_errors=True)  # a sandbox without a tenant: its own cache
        for leftover in (self.slots / f".{token}.lock", self.slots / f".{token}.{MARKER}"):
            leftover.unlink(missing_ok=True)
