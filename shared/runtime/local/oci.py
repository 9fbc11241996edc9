"""Unpack an untrusted container image archive into a root filesystem directory.

Two inputs are understood, both without any network access:

* ``docker save`` archives: ``manifest.json`` names the config and the layers,
  which are plain or compressed tars (legacy ``<id>/layer.tar``) or blobs under
  ``blobs/sha256/`` whose file name is their digest (Docker 25+).
* OCI image layouts, as a tar or a directory: ``index.json`` -> (nested index)
  -> manifest -> config and layers, every blob checked against its digest.

The image is untrusted, so extraction is done by hand rather than with
``tarfile.extract``: every path is normalised and must stay inside ``dest``,
every parent component is checked with ``os.lstat`` so that nothing is ever
written *through* a symlink (symlinks themselves may point anywhere: they are
only resolved inside the sandbox), hard links must target a file already inside
``dest``, device nodes and FIFOs are skipped, setuid/setgid bits are dropped,
ownership is left to the extracting user, and the total size and member count
are capped. Any failure removes what was written.
"""

from __future__ import annotations

import abc
import contextlib
import hashlib
import json
import os
import platform
import posixpath
import re
import shutil
import stat
import tarfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from sbx_api import errors

__all__ = ["ImageConfig", "ImageError", "unpack"]

DEFAULT_MAX_BYTES = 8 * 1024**3
DEFAULT_MAX_MEMBERS = 500_000
MAX_NAME = 4096
"""Longest entry or link name (PATH_MAX): a longer one is refused."""
MAX_DEPTH = 256
"""Most directory levels an entry may be below the root."""
MAX_HEADER = 1024**2
"""Largest PAX or GNU long-name header: ``tarfile`` reads one whole into memory."""
#: Directories the sandbox mounts over; created empty when the image lacks them.
MOUNT_POINTS = {"proc": 0o555, "dev": 0o755, "sys": 0o555, "tmp": 0o1777}

_JSON_LIMIT = 16 * 1024 * 1024
_CHUNK = 1024 * 1024
_MAX_LINK_HOPS = 40
_MAX_INDEX_DEPTH = 8
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_DIGEST = re.compile(r"^(sha256:[a-f0-9]{64}|sha512:[a-f0-9]{128})$")
_BLOB_NAME = re.compile(r"^blobs/sha256/([a-f0-9]{64})$")
_INDEX_TYPES = {
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
}
_MANIFEST_TYPES = {
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
}
_ARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}
WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
#: Directory modes always keep the owner's rwx so later layers and cleanup work without root.
DIR_OWNER = 0o700
#: Permission bits kept: everything except setuid and setgid.
KEEP_BITS = 0o1777


class ImageError(errors.InvalidInput):
    """The image archive is malformed, unsupported, or tries to escape its rootfs."""


@dataclass(frozen=True)
class ImageConfig:
    """The runtime defaults an image declares (the ``config`` section of its config JSON)."""

    env: list[str]
    cmd: list[str] | None
    entrypoint: list[str] | None
    working_dir: str | None
    user: str | None

    @classmethod
    def from_json(cls, document: Any) -> ImageConfig:
        if not isinstance(document, dict):
            raise ImageError("image config is not a JSON object")
        section = document.get("config") or {}
        if not isinstance(section, dict):
            raise ImageError("image config section is not a JSON object")
        return cls(
            env=_str_list(section.get("Env"), "Env") or [],
            cmd=_str_list(section.get("Cmd"), "Cmd"),
            entrypoint=_str_list(section.get("Entrypoint"), "Entrypoint"),
            working_dir=_opt_str(section.get("WorkingDir"), "WorkingDir"),
            user=_opt_str(section.get("User"), "User"),
        )


def _str_list(value: Any, field: str) -> list[str] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ImageError(f"image config field {field} must be a list of strings")
    return list(value)


def _opt_str(value: Any, field: str) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ImageError(f"image config field {field} must be a string")
    return value


# ---- public entry point -------------------------------------------------------


def unpack(
    archive: Path,
    dest: Path,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_members: int = DEFAULT_MAX_MEMBERS,
    progress: Callable[[int, int], None] | None = None,
) -> ImageConfig:
    """Unpack ``archive`` (docker-save tar, OCI layout tar or directory) into ``dest``.

    ``dest`` must not exist or be an empty directory. Returns the image's config.
    ``progress`` is told ``(layers unpacked, layers)`` before the first layer and after each.
    Raises :class:`ImageError` for anything wrong with the image, after removing
    whatever was written (``dest`` itself is removed unless it existed before).
    """
    archive = Path(archive)
    dest = Path(os.path.abspath(dest))
    created = _prepare_dest(dest)
    try:
        with _open_source(archive, max_members) as source:
            config, layers = _read_image(source)
            budget = Budget(max_bytes=max_bytes, max_members=max_members)
            for done, layer in enumerate(layers):
                if progress is not None:
                    progress(done, len(layers))
                _apply_layer(source, layer, dest, budget)
            if progress is not None:
                progress(len(layers), len(layers))
        _ensure_mount_points(dest)
        return config
    except BaseException as exc:
        _discard(dest, created)
        if isinstance(exc, ImageError):
            raise
        if isinstance(exc, (OSError, ValueError, EOFError, zlib.error, tarfile.TarError, RecursionError)):
            raise ImageError(f"cannot unpack image {archive}: {exc}") from exc
        raise


def _prepare_dest(dest: Path) -> bool:
    """Check ``dest`` is absent or an empty directory; create it. True when we created it."""
    try:
        st = os.lstat(dest)
    except FileNotFoundError:
        dest.mkdir(parents=True, mode=0o755)
        return True
    if not stat.S_ISDIR(st.st_mode):
        raise ImageError(f"destination {dest} exists and is not a directory")
    if any(dest.iterdir()):
        raise ImageError(f"destination {dest} is not empty")
    return False


def _discard(dest: Path, created: bool) -> None:
    if created:
        shutil.rmtree(dest, ignore_errors=True)
        return
    with contextlib.suppress(OSError):
        for child in dest.iterdir():
            remove_path(str(child))


# ---- reading the archive --------------------------------------------------------


class _Source(abc.ABC):
    """Read-only access to the files of an archive, by normalised relative name."""

    @abc.abstractmethod
    def open(self, name: str) -> IO[bytes]: ...

    @abc.abstractmethod
    def exists(self, name: str) -> bool: ...

    def close(self) -> None:  # noqa: B027 - a directory source has nothing to release
        """Release the underlying archive."""


class _TarSource(_Source):
    def __init__(self, path: Path, max_members: int) -> None:
        self._tar = tarfile.open(path, "r:*", tarinfo=BoundedTarInfo)
        self._members: dict[str, tarfile.TarInfo] = {}
        try:
            for count, member in enumerate(self._tar, start=1):
                if count > max_members:
                    raise ImageError(f"archive has more than {max_members} entries")
                with contextlib.suppress(ImageError):
                    self._members[_archive_path(member.name)] = member
        except BaseException:
            self._tar.close()
            raise

    def _resolve(self, name: str) -> tarfile.TarInfo:
        for _ in range(_MAX_LINK_HOPS):
            member = self._members.get(name)
            if member is None:
                raise ImageError(f"archive has no entry {name!r}")
            if member.issym():
                target = member.linkname
                joined = target if target.startswith("/") else posixpath.join(posixpath.dirname(name), target)
                name = _archive_path(joined)
            elif member.islnk():
                name = _archive_path(member.linkname)
            elif member.isreg():
                return member
            else:
                raise ImageError(f"archive entry {name!r} is not a regular file")
        raise ImageError(f"too many levels of links resolving {name!r}")

    def open(self, name: str) -> IO[bytes]:
        handle = self._tar.extractfile(self._resolve(name))
        if handle is None:  # pragma: no cover - _resolve only returns regular files
            raise ImageError(f"cannot read archive entry {name!r}")
        return handle

    def exists(self, name: str) -> bool:
        try:
            self._resolve(name)
        except ImageError:
            return False
        return True

    def close(self) -> None:
        self._tar.close()


def _archive_path(name: str) -> str:
    """Resolve a link target inside the archive: leading ``/`` means the archive root."""
    parts: list[str] = []
    for part in name.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if not parts:
                raise ImageError(f"archive link escapes the archive: {name!r}")
            parts.pop()
        else:
            parts.append(part)
    return "/".join(parts)


class _DirSource(_Source):
    def __init__(self, path: Path) -> None:
        self._root = os.path.realpath(path)

    def _path(self, name: str) -> str:
        real = os.path.realpath(os.path.join(self._root, _archive_path(name)))
        if os.path.commonpath([real, self._root]) != self._root:
            raise ImageError(f"layout entry {name!r} escapes the layout directory")
        return real

    def open(self, name: str) -> IO[bytes]:
        path = self._path(name)
        if not os.path.isfile(path):
            raise ImageError(f"layout has no file {name!r}")
        return open(path, "rb")

    def exists(self, name: str) -> bool:
        try:
            return os.path.isfile(self._path(name))
        except ImageError:
            return False


@contextlib.contextmanager
def _open_source(archive: Path, max_members: int) -> Iterator[_Source]:
    if archive.is_dir():
        source: _Source = _DirSource(archive)
    elif archive.is_file():
        try:
            source = _TarSource(archive, max_members)
        except tarfile.TarError as exc:
            raise ImageError(f"{archive} is not a tar archive: {exc}") from exc
    else:
        raise ImageError(f"image archive {archive} does not exist")
    try:
        yield source
    finally:
        source.close()


def _read_json(source: _Source, name: str) -> Any:
    with source.open(name) as handle:
        data = handle.read(_JSON_LIMIT + 1)
    if len(data) > _JSON_LIMIT:
        raise ImageError(f"{name} is too large")
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ImageError(f"{name} is not valid JSON: {exc}") from exc


def _hash_blob(source: _Source, name: str, algorithm: str) -> tuple[str, int]:
    digest = hashlib.new(algorithm)
    size = 0
    with source.open(name) as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def _verify(source: _Source, name: str, digest: str, size: int | None = None) -> None:
    algorithm, expected = digest.split(":", 1)
    actual, actual_size = _hash_blob(source, name, algorithm)
    if actual != expected:
        raise ImageError(f"digest mismatch for {name}: expected {digest}, got {algorithm}:{actual}")
    if size is not None and size != actual_size:
        raise ImageError(f"size mismatch for {name}: expected {size}, got {actual_size}")


@dataclass(frozen=True)
class _Layer:
    name: str
    digest: str | None
    size: int | None = None
    media_type: str | None = None


def _read_image(source: _Source) -> tuple[ImageConfig, list[_Layer]]:
    if source.exists("manifest.json"):
        return _read_docker_save(source)
    if source.exists("index.json"):
        return _read_oci_layout(source)
    raise ImageError("not an image archive: neither manifest.json (docker save) nor index.json (OCI)")


def _read_docker_save(source: _Source) -> tuple[ImageConfig, list[_Layer]]:
    manifest = _read_json(source, "manifest.json")
    if not isinstance(manifest, list) or not manifest or not isinstance(manifest[0], dict):
        raise ImageError("manifest.json must be a non-empty list of objects")
    entry = manifest[0]
    config_name, layer_names = entry.get("Config"), entry.get("Layers")
    if not isinstance(config_name, str) or not isinstance(layer_names, list):
        raise ImageError("manifest.json entry needs Config and Layers")
    config_name = _archive_path(config_name)
    if match := _BLOB_NAME.match(config_name):
        _verify(source, config_name, f"sha256:{match.group(1)}")
    config = ImageConfig.from_json(_read_json(source, config_name))
    layers = []
    for name in layer_names:
        if not isinstance(name, str):
            raise ImageError("manifest.json Layers must be strings")
        name = _archive_path(name)
        match = _BLOB_NAME.match(name)
        layers.append(_Layer(name=name, digest=f"sha256:{match.group(1)}" if match else None))
    return config, layers


def _blob_name(descriptor: Any) -> tuple[str, str, int | None]:
    if not isinstance(descriptor, dict):
        raise ImageError("OCI descriptor is not a JSON object")
    digest, size = descriptor.get("digest"), descriptor.get("size")
    if not isinstance(digest, str) or not _DIGEST.match(digest):
        raise ImageError(f"OCI descriptor has an invalid or unsupported digest: {digest!r}")
    if size is not None and (not isinstance(size, int) or size < 0):
        raise ImageError(f"OCI descriptor has an invalid size: {size!r}")
    algorithm, hexdigest = digest.split(":", 1)
    return f"blobs/{algorithm}/{hexdigest}", digest, size


def _read_blob_json(source: _Source, descriptor: Any) -> Any:
    name, digest, size = _blob_name(descriptor)
    _verify(source, name, digest, size)
    return _read_json(source, name)


def _pick_manifest(index: Any) -> Any:
    manifests = index.get("manifests") if isinstance(index, dict) else None
    if not isinstance(manifests, list) or not manifests:
        raise ImageError("OCI index lists no manifests")
    wanted = [_ARCH.get(platform.machine().lower()), "amd64"]

    def platform_of(descriptor: Any) -> tuple[str | None, str | None]:
        plat = descriptor.get("platform") if isinstance(descriptor, dict) else None
        if not isinstance(plat, dict):
            return None, None
        return plat.get("os"), plat.get("architecture")

    for arch in wanted:
        for descriptor in manifests:
            if arch is not None and platform_of(descriptor) == ("linux", arch):
                return descriptor
    for descriptor in manifests:
        if platform_of(descriptor)[0] != "unknown":  # skip buildkit attestation manifests
            break
    else:
        descriptor = manifests[0]
    if not isinstance(descriptor, dict):
        raise ImageError("OCI index entry is not a JSON object")
    return descriptor


def _read_oci_layout(source: _Source) -> tuple[ImageConfig, list[_Layer]]:
    document = _read_json(source, "index.json")
    for _ in range(_MAX_INDEX_DEPTH):
        descriptor = _pick_manifest(document)
        media_type = descriptor.get("mediaType")
        document = _read_blob_json(source, descriptor)
        if not isinstance(document, dict):
            raise ImageError("OCI manifest is not a JSON object")
        is_index = media_type in _INDEX_TYPES or (media_type is None and "manifests" in document)
        if is_index:
            continue
        if media_type is not None and media_type not in _MANIFEST_TYPES:
            raise ImageError(f"unsupported OCI manifest media type {media_type!r}")
        break
    else:
        raise ImageError("OCI index nesting is too deep")
    config = ImageConfig.from_json(_read_blob_json(source, document.get("config")))
    raw_layers = document.get("layers")
    if not isinstance(raw_layers, list):
        raise ImageError("OCI manifest has no layers list")
    layers = []
    for descriptor in raw_layers:
        name, digest, size = _blob_name(descriptor)
        media_type = descriptor.get("mediaType")
        if isinstance(media_type, str):
            if "zstd" in media_type:
                raise ImageError("zstd layers are not supported")
            if "tar" not in media_type:
                raise ImageError(f"unsupported layer media type {media_type!r}")
        layers.append(_Layer(name=name, digest=digest, size=size, media_type=media_type))
    return config, layers


# ---- applying layers --------------------------------------------------------------


@dataclass
class Budget:
    """What one unpack may write: bytes and entries (files, directories it implies,
    whiteouts), and a ``guard`` told before each write (the filesystem's free space)."""

    max_bytes: int
    max_members: int
    bytes: int = 0
    members: int = 0
    guard: Callable[[int, int], None] | None = None
    """Called with ``(bytes, entries)`` about to be written; raises to stop the unpack."""

    def member(self) -> None:
        self.members += 1
        if self.members > self.max_members:
            raise ImageError(f"image has more than {self.max_members} entries (SBX_IMAGE_MAX_ENTRIES)")
        if self.guard is not None:
            self.guard(0, 1)

    def take(self, size: int, *, written: bool = True) -> None:
        """Count ``size`` more bytes (``written``: about to be written now)."""
        if size < 0:
            raise ImageError("layer entry has a negative size")
        self.bytes += size
        if self.bytes > self.max_bytes:
            raise ImageError(f"image unpacks to more than {self.max_bytes} bytes (SBX_IMAGE_MAX_BYTES)")
        if self.guard is not None:
            self.guard(size if written else 0, 0)


class BoundedTarInfo(tarfile.TarInfo):
    """Refuses PAX and GNU long-name headers larger than :data:`MAX_HEADER`, which
    ``tarfile`` would read whole into memory (a few bytes of gzip can declare gigabytes)."""

    def _proc_member(self, tarfile_: tarfile.TarFile) -> tarfile.TarInfo:
        if self.type in _LONG_HEADERS and self.size > MAX_HEADER:
            raise tarfile.HeaderError(f"a tar header of {self.size} bytes (at most {MAX_HEADER})")
        member: tarfile.TarInfo = super()._proc_member(tarfile_)  # type: ignore[misc]
        return member


_LONG_HEADERS = (
    tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE, tarfile.GNUTYPE_LONGNAME,
    tarfile.GNUTYPE_LONGLINK,
)  # fmt: skip


def open_layer(raw: IO[bytes]) -> tarfile.TarFile:
    """A layer tar (plain or compressed) read as a stream, headers bounded."""
    return tarfile.open(fileobj=raw, mode="r|*", tarinfo=BoundedTarInfo)


def _apply_layer(source: _Source, layer: _Layer, dest: Path, budget: Budget) -> None:
    if layer.digest is not None:
        _verify(source, layer.name, layer.digest, layer.size)
    with source.open(layer.name) as raw:
        head = raw.read(4)
    if head.startswith(_ZSTD_MAGIC):
        raise ImageError("zstd layers are not supported")
    with source.open(layer.name) as raw:
        try:
            tar = open_layer(raw)
        except tarfile.TarError as exc:
            raise ImageError(f"layer {layer.name} is not a (compressed) tar: {exc}") from exc
        with tar:
            Extractor(str(dest), budget).run(tar)


def clean_member_name(name: str) -> str:
    """A member path relative to the rootfs; absolute paths and ``..`` are refused."""
    if "\x00" in name:
        raise ImageError(f"layer entry name contains a NUL byte: {name!r}")
    if len(name) > MAX_NAME:
        raise ImageError(f"layer entry name is longer than {MAX_NAME} characters: {name[:80]!r}...")
    if name.startswith("/"):
        raise ImageError(f"layer entry has an absolute path: {name!r}")
    parts = [part for part in name.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise ImageError(f"layer entry path contains '..': {name!r}")
    if len(parts) > MAX_DEPTH:
        raise ImageError(f"layer entry is more than {MAX_DEPTH} directories deep: {name[:80]!r}...")
    return "/".join(parts)


def remove_path(path: str) -> None:
    """Remove whatever is at ``path`` without following a symlink there."""
    st = os.lstat(path)
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


class Extractor:
    """Apply one layer's entries onto the rootfs at ``root``."""

    def __init__(self, root: str, budget: Budget) -> None:
        self.root = root
        self.budget = budget
        #: Paths this layer wrote, plus all their ancestors: whiteouts must keep them.
        self.touched: set[str] = set()

    def run(self, tar: tarfile.TarFile) -> None:
        while (member := tar.next()) is not None:
            # Stream mode: do not keep every header in memory (``members`` is the list
            # ``next()`` appends to; typeshed does not declare it).
            tar.members.clear()  # type: ignore[attr-defined]
            self.budget.member()
            self.entry(tar, member)

    # -- paths

    def _mark(self, rel: str) -> None:
        while rel and rel not in self.touched:
            self.touched.add(rel)
            rel = posixpath.dirname(rel)

    def _parent(self, parts: list[str], *, create: bool) -> str | None:
        """The real directory holding ``parts[-1]``; never crosses a symlink."""
        current = self.root
        for index, part in enumerate(parts[:-1]):
            current = os.path.join(current, part)
            try:
                st = os.lstat(current)
            except FileNotFoundError:
                if not create:
                    return None
                self.budget.member()  # a directory the entry implies is an inode too
                os.mkdir(current, 0o755)
                os.chmod(current, 0o755)  # noqa: S103 - a rootfs directory, as docker creates it
                self._mark("/".join(parts[: index + 1]))
                continue
            if stat.S_ISLNK(st.st_mode):
                rel = "/".join(parts[: index + 1])
                raise ImageError(f"layer writes through the symlink {rel!r}")
            if not stat.S_ISDIR(st.st_mode):
                if not create:
                    return None
                raise ImageError(f"layer entry {'/'.join(parts)!r} is below a non-directory")
        return current

    # -- entries

    def entry(self, tar: tarfile.TarFile, member: tarfile.TarInfo) -> None:
        if not member.isreg():  # (what tarfile inflates to skip an entry's data counts too)
            self.budget.take(member.size, written=False)
        rel = clean_member_name(member.name)
        if not rel:
            return  # the root directory itself
        parts = rel.split("/")
        base = parts[-1]
        if base.startswith(WHITEOUT):
            self.whiteout(parts)
            return
        if not (member.isreg() or member.isdir() or member.issym() or member.islnk()):
            return  # device nodes, FIFOs and unknown types have no place in a sandbox rootfs
        parent = self._parent(parts, create=True)
        assert parent is not None
        path = os.path.join(parent, base)
        if member.islnk():
            self.hardlink(rel, path, member)
            return
        try:
            existing = os.lstat(path)
        except FileNotFoundError:
            existing = None
        mode = member.mode & KEEP_BITS
        if member.isdir():
            if existing is not None and not stat.S_ISDIR(existing.st_mode):
                os.unlink(path)
                existing = None
            if existing is None:
                os.mkdir(path, 0o700)
            os.chmod(path, mode | DIR_OWNER)
        else:
            if existing is not None:
                remove_path(path)
            if member.issym():
                os.symlink(member.linkname, path)
            else:
                self.write_file(tar, member, path, mode)
        self._mark(rel)

    def write_file(self, tar: tarfile.TarFile, member: tarfile.TarInfo, path: str, mode: int) -> None:
        self.budget.take(member.size)
        handle = tar.extractfile(member)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(path, flags, 0o600)
        with os.fdopen(fd, "wb") as out:
            if handle is not None:
                with handle:
                    shutil.copyfileobj(handle, out, _CHUNK)
            os.fchmod(out.fileno(), mode)
            if os.utime in os.supports_fd:
                with contextlib.suppress(OSError, OverflowError, ValueError):
                    os.utime(out.fileno(), (member.mtime, member.mtime))

    def hardlink(self, rel: str, path: str, member: tarfile.TarInfo) -> None:
        target_rel = clean_member_name(member.linkname)
        if not target_rel:
            raise ImageError(f"hard link {rel!r} points at the root directory")
        if target_rel == rel:
            return
        target_parts = target_rel.split("/")
        target_parent = self._parent(target_parts, create=False)
        if target_parent is None:
            raise ImageError(f"hard link {rel!r} points at a missing file {target_rel!r}")
        target = os.path.join(target_parent, target_parts[-1])
        try:
            st = os.lstat(target)
        except FileNotFoundError:
            raise ImageError(f"hard link {rel!r} points at a missing file {target_rel!r}") from None
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
            raise ImageError(f"hard link {rel!r} points at {target_rel!r}, which is not a file")
        with contextlib.suppress(FileNotFoundError):
            remove_path(path)
        os.link(target, path, follow_symlinks=False)
        self._mark(rel)

    def whiteout(self, parts: list[str]) -> None:
        base = parts[-1]
        if base == OPAQUE:
            # ``_parent`` of a child of the directory checks the directory itself too.
            directory = self._parent([*parts[:-1], ""], create=False)
            if directory is None:
                return
            prefix = "/".join(parts[:-1])
            for child in os.listdir(directory):
                self._remove_lower(posixpath.join(prefix, child) if prefix else child)
            return
        if base.startswith(WHITEOUT + WHITEOUT):
            return  # other aufs metadata (.wh..wh.plnk, ...): not part of the filesystem
        name = base[len(WHITEOUT) :]
        if name in ("", ".", ".."):
            raise ImageError(f"invalid whiteout entry {'/'.join(parts)!r}")
        target = [*parts[:-1], name]
        if self._parent(target, create=False) is None:
            return
        self._remove_lower("/".join(target))

    def _remove_lower(self, rel: str) -> None:
        """Remove ``rel`` as it came from lower layers, keeping what this layer wrote."""
        pending = [rel]
        while pending:
            current = pending.pop()
            path = os.path.join(self.root, current)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            if current not in self.touched:
                remove_path(path)
            elif stat.S_ISDIR(st.st_mode):
                pending.extend(posixpath.join(current, child) for child in os.listdir(path))


def _ensure_mount_points(dest: Path) -> None:
    for name, mode in MOUNT_POINTS.items():
        path = os.path.join(dest, name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            st = None
        if st is not None and stat.S_ISDIR(st.st_mode):
            continue
        if st is not None:
            os.unlink(path)
        os.mkdir(path, 0o700)
        os.chmod(path, mode | DIR_OWNER)
