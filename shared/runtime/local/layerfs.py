"""Unpacking one image layer into a directory of its own, as an overlayfs lower layer.

The layer store (``layers.py``) keeps every layer unpacked once and stacks an image's
layers as overlay lower directories, so the layer's changes must be kept in the form
overlayfs reads, instead of being applied onto the layers below:

* a whiteout ``.wh.NAME`` becomes a character device 0/0 named ``NAME`` (overlayfs's
  whiteout), which hides ``NAME`` of the layers below;
* an opaque marker ``.wh..wh..opq`` sets ``user.overlay.opaque=y`` on its directory
  (bubblewrap mounts overlays with ``userxattr``), which hides what the layers below
  have in it.

Everything else is ``oci.Extractor``'s: no path escapes, nothing written through a
symlink, set-id bits dropped, devices and FIFOs skipped, sizes and entry counts capped.
A hard link to a file of a lower layer (allowed by the OCI spec) is a copy here, and a
directory the layer implies without an entry of its own takes the mode it has below: so
a layer's unpacked form depends on the layers below it, and the store keys it by all of
them (``layers.chain_keys``), never by its own digest alone.
"""

from __future__ import annotations

import gzip
import os
import shutil
import stat
import tarfile
import zlib
from collections.abc import Sequence
from pathlib import Path

from shared.runtime.local import oci

OPAQUE_XATTR = "user.overlay.opaque"


def unpack_layer(blob: Path, dest: Path, lowers: Sequence[Path], budget: oci.Budget) -> None:
    """Unpack the layer tar ``blob`` (plain or gzip) into the new directory ``dest``.
    ``lowers``: the unpacked layers below it, the nearest first. Raises ImageError."""
    with blob.open("rb") as raw:
        head = raw.read(4)
    if head.startswith(b"\x28\xb5\x2f\xfd"):
        raise oci.ImageError("zstd-compressed layers are not supported yet; use a gzip image")
    dest.mkdir(mode=0o755)
    try:
        with blob.open("rb") as raw, oci.open_layer(raw) as tar:
            LayerExtractor(str(dest), budget, [str(p) for p in lowers]).run(tar)
    except (OSError, EOFError, zlib.error, gzip.BadGzipFile, tarfile.TarError) as exc:
        if isinstance(exc, OSError) and exc.errno == 28:
            raise oci.ImageError(
                f"no space left on the device while unpacking a layer into {dest.parent}"
            ) from exc
        raise oci.ImageError(f"the layer is not a valid (gzip) tar: {exc}") from exc


class LayerExtractor(oci.Extractor):
    def __init__(self, root: str, budget: oci.Budget, lowers: list[str]) -> None:
        super().__init__(root, budget)
        self.lowers = lowers

    def find(self, rel: str) -> tuple[str, os.stat_result] | None:
        """Where the layers below show ``rel``, as overlayfs merges them: the nearest
        layer that has it, unless a whiteout or an opaque directory on the way hides it."""
        for lower in self.lowers:
            path, hidden = lower, False
            parts = rel.split("/")
            for index, part in enumerate(parts):
                path = os.path.join(path, part)
                try:
                    st = os.lstat(path)
                except FileNotFoundError:
                    break  # not in this layer: look below
                if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
                    return None  # whited out here: hidden in every layer below too
                if index == len(parts) - 1:
                    return path, st
                if not stat.S_ISDIR(st.st_mode):
                    return None  # a file or symlink here hides the path below
                hidden = hidden or _opaque(path)
            if hidden:
                return None
        return None

    def _parent(self, parts: list[str], *, create: bool) -> str | None:
        parent = super()._parent(parts, create=create)
        if create and parent is not None:  # directories made just now take the mode from below
            for index in range(1, len(parts)):
                rel = "/".join(parts[:index])
                below = self.find(rel)
                if rel in self.touched and below is not None and stat.S_ISDIR(below[1].st_mode):
                    path = os.path.join(self.root, rel)
                    if stat.S_IMODE(os.lstat(path).st_mode) == 0o755:
                        os.chmod(path, (below[1].st_mode & oci.KEEP_BITS) | oci.DIR_OWNER)
        return parent

    def whiteout(self, parts: list[str]) -> None:
        base = parts[-1]
        if base == oci.OPAQUE:
            directory = self._parent([*parts[:-1], ""], create=True)
            assert directory is not None
            if len(parts) > 1:
                rel = "/".join(parts[:-1])
                path = os.path.join(self.root, rel)
                if not os.path.isdir(path) or os.path.islink(path):
                    raise oci.ImageError(f"opaque marker below a non-directory: {rel!r}")
                os.setxattr(path, OPAQUE_XATTR, b"y", follow_symlinks=False)
                self._mark(rel)
            return
        if base.startswith(oci.WHITEOUT + oci.WHITEOUT):
            return  # other aufs metadata (.wh..wh.plnk, ...)
        name = base[len(oci.WHITEOUT) :]
        if name in ("", ".", ".."):
            raise oci.ImageError(f"invalid whiteout entry {'/'.join(parts)!r}")
        rel = "/".join([*parts[:-1], name])
        if rel in self.touched:
            return  # this layer's own entry: a whiteout hides only the layers below
        parent = self._parent([*parts[:-1], name], create=True)
        assert parent is not None
        path = os.path.join(parent, name)
        if os.path.lexists(path):
            oci.remove_path(path)
        try:
            os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(0, 0))
        except PermissionError:
            raise oci.ImageError(
                "unpacking a layer with deletions needs root (mknod of a whiteout)"
            ) from None

    def hardlink(self, rel: str, path: str, member: tarfile.TarInfo) -> None:
        target_rel = oci.clean_member_name(member.linkname)
        if target_rel and os.path.lexists(os.path.join(self.root, target_rel)):
            super().hardlink(rel, path, member)
            return
        found = self.find(target_rel) if target_rel else None
        if found is None or not stat.S_ISREG(found[1].st_mode):
            raise oci.ImageError(f"hard link {rel!r} points at a missing file {target_rel!r}")
        source, st = found
        self.budget.take(st.st_size)
        if os.path.lexists(path):
            oci.remove_path(path)
        shutil.copy2(source, path, follow_symlinks=False)
        os.chmod(path, stat.S_IMODE(os.lstat(path).st_mode) & oci.KEEP_BITS)
        self._mark(rel)


def _opaque(path: str) -> bool:
    try:
        return os.getxattr(path, OPAQUE_XATTR, follow_symlinks=False) == b"y"
    except OSError:
        return False
