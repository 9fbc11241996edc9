"""The host's mount table as the local runtime sees it: what is mounted where, and
detaching everything below a directory (before a state dir is removed)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
from pathlib import Path

from sbx_api import errors

MNT_DETACH = 2
_ESCAPE = re.compile(rb"\\([0-7]{3})")
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)


def mount_points() -> list[bytes]:
    """Every mount point of this mount namespace (mountinfo's octal escapes undone)."""
    with open("/proc/self/mountinfo", "rb") as info:
        return [_ESCAPE.sub(lambda m: bytes([int(m.group(1), 8)]), line.split(b" ", 5)[4]) for line in info]


def mounted_on(target: Path) -> int:
    """How many mounts are stacked on ``target`` (an absolute, resolved path)."""
    wanted = os.fsencode(target)
    return sum(1 for point in mount_points() if point == wanted)


def mounts_under(target: Path) -> list[Path]:
    """The mount points on ``target`` or below it (resolved), deepest first."""
    wanted = os.fsencode(os.path.realpath(target))
    found = {p for p in mount_points() if p == wanted or p.startswith(wanted + b"/")}
    return [Path(os.fsdecode(p)) for p in sorted(found, key=lambda p: (-p.count(b"/"), p))]


def mounted_under(target: Path) -> bool:
    """Whether anything is mounted on ``target`` or below it."""
    return bool(mounts_under(target))


def detach_under(target: Path, rounds: int = 8) -> None:
    """Lazily unmount everything strictly below ``target`` (stacked mounts included; not
    ``target`` itself); raises if anything is still mounted below it after that."""

    def below() -> list[Path]:
        root = Path(os.path.realpath(target))
        return [p for p in mounts_under(root) if p != root]

    for _ in range(rounds):
        points = below()
        if not points:
            return
        for point in points:
            _libc.umount2(os.fsencode(point), MNT_DETACH)
    if left := below():
        raise errors.InfrastructureError(f"{left[0]} is still mounted: not removed")
