"""Per-tenant package caches on the local runtime.

A sandbox is created before anyone knows whose it will be (warm pool), so its cache is
attached when a session of an organisation first uses it. No mount is made on the host
per sandbox (every host mount is copied, made a slave and detached again by each later
sandbox's start: a cost that would grow with the number alive):

* at start, bubblewrap binds at :data:`CACHE_DIR` the sandbox's *slot*
  ``<state>/cache-slots/<token>`` (a plain directory: a cache of its own), or, for a
  sandbox that shows an organisation's cache, that cache ``<state>/caches/<org token>``
  (bound onto itself once per organisation, without setuid or devices);
* attaching to a running sandbox clones that cache's mount (``open_tree``) and moves
  the clone onto :data:`CACHE_DIR` inside the sandbox's own mount namespace (``setns``
  in a forked child, ``move_mount``): the host's mount table is unchanged.

Sandboxes are never reused across sessions, so a slot carries one organisation's
cache for the sandbox's whole life (a marker beside the slot says which); attaching
another one is refused. A sandbox whose session has no organisation keeps its slot: a
cache of its own, deleted with it.

Slots live outside the sandboxes' directories and caches are never mounted below a
slot on the host, so removing a sandbox can never reach into a cache.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import os
import shutil
from pathlib import Path

from sbx_api import errors
from shared.runtime import api
from shared.runtime.local import nsmount
from shared.runtime.local.mounts import mounted_on, mounted_under

CACHE_DIR = api.CACHE_DIR
ENV = api.CACHE_ENV
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_REMOUNT = 0x20
MS_BIND = 0x1000
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


def _private_dir(path: Path) -> None:
    """A directory only root can enter: nothing a sandbox leaves in a cache (a setuid
    file) is reachable by other host users, whatever the state dir's own mode is."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)


class Caches:
    def __init__(self, state_dir: Path) -> None:
        root = Path(os.path.realpath(state_dir))  # mountinfo shows resolved paths
        self.slots = root / "cache-slots"
        self.caches = root / "caches"

    def slot(self, token: str) -> Path:
        return self.slots / token

    def _lock(self, token: str) -> int:
        _private_dir(self.slots)
        fd = os.open(self.slots / f".{token}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        return fd

    def prepare(self, token: str, own: Path | None = None, key: str | None = None) -> Path:
        """What bubblewrap binds at :data:`CACHE_DIR` when the sandbox starts (call
        before each start): cache ``key`` (an organisation's pool sandbox; a stopped one
        that showed it), else ``own`` (its cache of its own on its own disk, so that it
        counts against its limit), else its slot directory. Nothing is mounted per sandbox."""
        _check_key(key)
        fd = self._lock(token)
        try:
            slot = self.slot(token)
            slot.mkdir(exist_ok=True, mode=0o700)
            if key is None:
                return own or slot
            self._claim(token, key)
            return self._cache_mount(key)
        finally:
            os.close(fd)

    def attach(self, token: str, key: str, pid: int | None = None) -> bool:
        """Show cache ``key`` in the sandbox (the one whose init is ``pid`` while it runs,
        else from its next start); False if it already did. A slot that carries another
        cache refuses (Conflict); a deleted sandbox's is NotRunning."""
        _check_key(key)
        fd = self._lock(token)
        try:
            if not self.slot(token).is_dir():
                raise errors.NotRunning("the sandbox has no cache slot (deleted, or never started)")
            if self.attached(token) == key:
                return False
            self._claim(token, key, write=False)
            if pid is not None:
                nsmount.bind_into(pid, self._cache_mount(key), CACHE_DIR)
            self._claim(token, key)
            return True
        finally:
            os.close(fd)

    def _claim(self, token: str, key: str, *, write: bool = True) -> None:
        """Record that the slot carries ``key`` (Conflict if it carries another)."""
        current = self.attached(token)
        if current and current != key:
            raise errors.Conflict("this sandbox already shows another organisation's cache")
        if write and current != key:
            (self.slots / f".{token}.{MARKER}").write_text(key + "\n")

    def _cache_mount(self, key: str) -> Path:
        """The cache's directory, bind-mounted onto itself without setuid or devices."""
        _private_dir(self.caches)
        cache = self.caches / key
        cache.mkdir(exist_ok=True, mode=0o700)
        if mounted_on(cache) == 0:
            _mount(cache, cache, MS_BIND)
            _mount(None, cache, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV)
        return cache

    def attached(self, token: str) -> str | None:
        """The cache the sandbox's slot carries (kept while it is stopped), if any."""
        marker = self.slots / f".{token}.{MARKER}"
        try:
            return marker.read_text().strip() or None
        except FileNotFoundError:
            return None

    def _unmount_slot(self, slot: Path) -> None:
        for _ in range(8):
            if not slot.exists() or mounted_on(slot) == 0:
                return
            if _libc.umount2(os.fsencode(slot), MNT_DETACH) != 0:
                code = ctypes.get_errno()
                raise errors.InfrastructureError(f"unmounting {slot} failed: {os.strerror(code)}")

    def detach(self, token: str) -> None:
        """Undo what an earlier version mounted on the slot on the host (a stopped sandbox
        holds no mount); which cache it carries is kept, and the next :meth:`prepare`
        shows it again."""
        fd = self._lock(token)
        try:
            self._unmount_slot(self.slot(token))
        finally:
            os.close(fd)

    def release(self, token: str) -> None:
        """Detach everything mounted on the slot, then remove what is left of it, under the
        slot's lock: an attach either finished before (and is detached here) or finds no
        slot after. Nothing is removed while anything is mounted on or below the slot."""
        fd = self._lock(token)
        try:
            slot = self.slot(token)
            self._unmount_slot(slot)
            if slot.exists():
                if mounted_under(slot):
                    raise errors.InfrastructureError(f"{slot} still has mounts: not removed")
                shutil.rmtree(slot, ignore_errors=True)  # a sandbox without a tenant: its own cache
            (self.slots / f".{token}.{MARKER}").unlink(missing_ok=True)
        finally:
            os.close(fd)
        (self.slots / f".{token}.lock").unlink(missing_ok=True)

    def detach_all(self) -> None:
        """Undo the caches' own binds (when nothing uses them any more: after every
        sandbox of this state dir is deleted). Their files stay."""
        if not self.caches.exists():
            return
        for cache in self.caches.iterdir():
            for _ in range(8):
                if mounted_on(cache) == 0 or _libc.umount2(os.fsencode(cache), MNT_DETACH) != 0:
                    break


def _check_key(key: str | None) -> None:
    if key is not None and (not key or not all(c in "0123456789abcdef" for c in key)):
        raise errors.InvalidInput("a cache key is a hex token")
