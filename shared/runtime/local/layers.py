"""The content-addressed layer store: images pulled from registries, each layer once.

Under ``<state>/images/``:

* ``layers/<key>/`` one layer, unpacked as an overlay lower directory (``layerfs``),
  named by its *chain*: the digest of its blob and of every layer below it
  (``chain_keys``), because unpacking a layer may read the layers below (a hard link to
  a lower file is a copy, an implied directory takes its mode from below). Two images
  share a layer directory only when they share the whole stack under it, so no image's
  layers can decide another's files. ``layers/<key>.json`` its sizes. Shared read-only by
  every sandbox of every image that has it: nothing is copied per sandbox. (Images
  recorded before chains name their layers by digest alone, and keep them.)
* ``manifests/<hex>.json`` one pulled image (by manifest digest): its reference, its
  layers bottom to top, its config; ``manifests/<hex>.top/`` the small directory every
  sandbox of it has on top (mount points, our ``/etc/hosts``, the sandbox user).
  Its modification time is when a sandbox last used it.
* ``tags/<token>.json`` which digest a tag was resolved to, once (``sbx image pull``
  resolves it again).
* ``locks/`` flocks: one pull per reference and one download per layer at a time across
  every process on this machine; ``hold-<key>`` held shared by every pull using a layer
  until its image is recorded; ``store.lock`` held shared by pulls and sandbox creation,
  exclusively by prune, so prune never takes what is being used.

Blobs are downloaded next to the store, checked against their digest, unpacked, and
removed; a layer directory or an image record only ever appears complete (renamed into
place), so a crash or a full disk leaves nothing half-registered. A pull that fails
removes the layers it used that no image has and no other pull holds: a failed or
refused pull leaves nothing behind.

Before any blob is asked for, the manifest's layer count and total size are checked
(``max_layers``, ``max_bytes``); while blobs download and unpack, every write is checked
against the filesystem's free bytes and inodes minus the reserves (``disk.Headroom``), and the
unpacked bytes and entries of the pull against ``max_bytes`` and ``max_entries``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import json
import os
import shutil
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sbx_api import errors
from shared.contract import ids, references
from shared.runtime.local import bwrap, disk, layerfs, oci, registry
from shared.runtime.local.registries import RegistryConfig

LAYER_TYPES = (
    "application/vnd.oci.image.layer.v1.tar",
    "application/vnd.oci.image.layer.v1.tar+gzip",
    "application/vnd.docker.image.rootfs.diff.tar.gzip",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip",
    "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip",
)
DOWNLOADS = 4
"""Layers downloaded at once for one pull."""
MAX_LAYERS = 128
"""Most layers an image may have (``SBX_IMAGE_MAX_LAYERS``): Docker's own limit is 127."""
TRUST_STORE = "etc/ssl/certs/ca-certificates.crt"
#: Mount points and our own files every sandbox of a pulled image has on top.
TOP_DIRS = {
    "proc": 0o555,
    "dev": 0o755,
    "sys": 0o555,
    "tmp": 0o1777,
    "workspace": 0o755,
    ".sbx": 0o700,
    ".sbx-out": 0o1777,
    "root": 0o700,
    f"home/{bwrap.SANDBOX_USER}": 0o755,
    "etc/sbx": 0o755,
}


@dataclass(frozen=True)
class Pulled:
    """One image in the store."""

    reference: str
    """The normalised reference it was pulled by (``docker.io/library/python:3.12``)."""
    digest: str
    """Its manifest digest (what sandboxes of it are pinned to)."""
    layers: tuple[str, ...]
    """Layer digests, bottom first."""
    config: oci.ImageConfig
    size: int
    """Compressed bytes of its layers (what was downloaded)."""
    unpacked: int
    trust_store: bool = False
    """Whether it has Debian's/Alpine's trust store file (the proxy's CA is shown there)."""
    has_bash: bool = True
    has_sh: bool = True
    fetched: int = 0
    """Layers downloaded by the pull that returned this (0: all were in the store)."""
    downloaded: int = 0
    """Bytes those layers were."""
    dirs: tuple[str, ...] = ()
    """The layers' directories under ``layers/``, bottom first (their chain keys)."""

    @property
    def hex(self) -> str:
        return self.digest.split(":", 1)[1]


def chain_keys(digests: Sequence[str]) -> list[str]:
    """Where each layer of an image is unpacked (pure): the bottom one by its digest (it
    reads nothing below), each other by the hash of the key below it and its own digest,
    as OCI's ChainID is made. Equal keys mean equal stacks, hence equal unpacked files."""
    keys: list[str] = []
    for digest in digests:
        chain = (
            digest
            if not keys
            else "sha256:" + hashlib.sha256(f"sha256:{keys[-1]} {digest}".encode()).hexdigest()
        )
        keys.append(chain.split(":", 1)[1])
    return keys


class Progress:
    """What a pull reports as it goes (all from worker threads; the default ignores it)."""

    def layers(self, layers: Sequence[tuple[str, int | None, bool]]) -> None:
        """Every layer: digest, size, whether it is in the store already."""

    def advanced(self, digest: str, count: int) -> None:
        """``count`` more bytes of a layer arrived (negative: a retry starts it again)."""

    def unpacked(self, digest: str) -> None:
        """A layer is ready."""


@dataclass
class LayerStore:
    root: Path
    config: RegistryConfig = field(default_factory=RegistryConfig)
    max_bytes: int = oci.DEFAULT_MAX_BYTES
    """Most bytes one image may download, and most it may unpack to."""
    timeout: float = 600.0
    reserve: int = 0
    """Free space the filesystem keeps: a pull that would go below it is refused."""
    reserve_inodes: int = 0
    """Free inodes the filesystem keeps, likewise."""
    max_layers: int = MAX_LAYERS
    max_entries: int = oci.DEFAULT_MAX_MEMBERS
    """Most files, directories and links one pull may unpack."""
    resolver: registry.Resolver = registry.resolve_addresses
    """How registry names are resolved (tests give one)."""

    def __post_init__(self) -> None:
        for sub in ("layers", "manifests", "tags", "locks", "blobs"):
            (self.root / sub).mkdir(parents=True, exist_ok=True, mode=0o700)

    # ---- reading ---------------------------------------------------------------

    def cached(self, ref: references.Reference) -> Pulled | None:
        """The image ``ref`` names if it is in the store (a tag: as resolved last)."""
        digest = ref.digest or self._tag(ref)
        return self.get(digest) if digest else None

    def get(self, digest: str) -> Pulled | None:
        try:
            raw = json.loads((self.root / "manifests" / f"{digest.split(':', 1)[1]}.json").read_text())
        except (OSError, ValueError, IndexError):
            return None
        config = oci.ImageConfig(
            env=raw["env"],
            cmd=None,
            entrypoint=None,
            working_dir=raw.get("working_dir"),
            user=raw.get("user"),
        )
        return Pulled(
            reference=raw["reference"],
            digest=raw["digest"],
            layers=tuple(raw["layers"]),
            config=config,
            size=raw["size"],
            unpacked=raw["unpacked"],
            trust_store=raw.get("trust_store", False),
            has_bash=raw.get("has_bash", True),
            has_sh=raw.get("has_sh", True),
            dirs=tuple(raw.get("dirs") or (d.split(":", 1)[1] for d in raw["layers"])),
        )

    def all(self) -> list[Pulled]:
        out = []
        for path in sorted((self.root / "manifests").glob("*.json")):
            if (image := self.get(f"sha256:{path.stem}")) is not None:
                out.append(image)
        return out

    def last_used(self, image: Pulled) -> float:
        try:
            return (self.root / "manifests" / f"{image.hex}.json").stat().st_mtime
        except OSError:
            return 0.0

    def touch(self, image: Pulled) -> None:
        with contextlib.suppress(OSError):
            os.utime(self.root / "manifests" / f"{image.hex}.json")

    def lower_dirs(self, image: Pulled) -> tuple[Path, ...]:
        """The overlay lower directories of a sandbox of ``image``, bottom first."""
        layers = [self.root / "layers" / key for key in image.dirs]
        return (*layers, self.root / "manifests" / f"{image.hex}.top")

    def _tag(self, ref: references.Reference) -> str | None:
        try:
            digest = json.loads((self.root / "tags" / f"{ids.token(str(ref))}.json").read_text())["digest"]
            return digest if isinstance(digest, str) else None
        except (OSError, ValueError, KeyError):
            return None

    # ---- locks -------------------------------------------------------------------

    @contextlib.contextmanager
    def _flock(self, name: str, mode: int = fcntl.LOCK_EX) -> Iterator[None]:
        fd = os.open(self.root / "locks" / name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, mode)
            yield
        finally:
            os.close(fd)

    def using(self) -> contextlib.AbstractContextManager[None]:
        """Held (shared) while an image is pulled or a sandbox is pinned to one."""
        return self._flock("store.lock", fcntl.LOCK_SH)

    # ---- pulling -----------------------------------------------------------------

    def pull(
        self, ref: references.Reference, *, refresh: bool = False, progress: Progress | None = None
    ) -> Pulled:
        """The image in the store, pulled first unless there (``refresh``: resolve its
        tag at the registry again). Blocking: call from a thread."""
        progress = progress or Progress()
        with self.using(), self._flock(f"pull-{ids.token(ref.name + '@' + (ref.digest or ref.tag or ''))}"):
            if not refresh and (have := self.cached(ref)) is not None:
                return have
            client = registry.Client(self.config, resolver=self.resolver)
            client.deadline = time.monotonic() + self.timeout
            watchdog = threading.Timer(self.timeout, client.expire)  # (wakes reads a trickle holds)
            watchdog.daemon = True
            watchdog.start()
            try:
                return self._pull(client, ref, progress)
            except errors.SandboxError as exc:
                if str(ref) in exc.message:
                    raise
                raise type(exc)(f"pulling {ref}: {exc.message}") from None
            finally:
                watchdog.cancel()
                client.close()

    def _pull(self, client: registry.Client, ref: references.Reference, progress: Progress) -> Pulled:
        manifest = client.resolve(ref)
        client.check_deadline()
        if (have := self.get(manifest.digest)) is not None:
            self._record_tag(ref, manifest.digest)
            return have
        layers = [_layer(ref, descriptor) for descriptor in manifest.layers]
        self._check_manifest(ref, layers)  # before any blob is asked for
        config = oci.ImageConfig.from_json(client.blob_json(ref, manifest.config))
        keys = chain_keys([d for d, _ in layers])
        try:
            with contextlib.ExitStack() as holds:
                for key in dict.fromkeys(keys):
                    holds.enter_context(self._flock(f"hold-{key}", fcntl.LOCK_SH))
                return self._assemble(client, ref, manifest.digest, config, layers, keys, progress)
        except BaseException:
            self._remove_unheld(keys)
            raise

    def _check_manifest(self, ref: references.Reference, layers: list[tuple[str, int | None]]) -> None:
        if len(layers) > self.max_layers:
            raise oci.ImageError(
                f"{ref} has {len(layers)} layers, more than the limit of {self.max_layers} "
                "(SBX_IMAGE_MAX_LAYERS)"
            )
        size = sum(s or 0 for _, s in layers)
        if size > self.max_bytes:
            raise oci.ImageError(
                f"{ref} is {size} bytes to download, more than the limit of {self.max_bytes} "
                "(SBX_IMAGE_MAX_BYTES)"
            )

    def _assemble(
        self,
        client: registry.Client,
        ref: references.Reference,
        digest: str,
        config: oci.ImageConfig,
        layers: list[tuple[str, int | None]],
        keys: list[str],
        progress: Progress,
    ) -> Pulled:
        """Download and unpack the layers not in the store yet, then record the image
        (every layer's hold is taken)."""
        present = {key for key in keys if self._layer_ready(key)}
        self._check_space(
            sum(s or 0 for (_, s), k in zip(layers, keys, strict=True) if k not in present), ref
        )
        progress.layers([(d, s, k in present) for (d, s), k in zip(layers, keys, strict=True)])
        headroom = disk.Headroom(
            self.root,
            disk.Disk(reserve_bytes=self.reserve, reserve_inodes=self.reserve_inodes),
            lambda why: (
                f"not enough disk space to pull {ref}: {why}; nothing was kept; prune images "
                "(`sbx image prune`)"
            ),
        )

        def guard(size: int, entries: int) -> None:  # (the unpack too ends at the pull's deadline)
            client.check_deadline()
            headroom(size, entries)

        budget = oci.Budget(max_bytes=self.max_bytes, max_members=self.max_entries, guard=guard)
        fetched = downloaded = 0
        downloads: dict[str, concurrent.futures.Future[Path | None]] = {}
        try:
            with concurrent.futures.ThreadPoolExecutor(DOWNLOADS, thread_name_prefix="sbx-pull") as pool:
                stop = threading.Event()
                for (layer_digest, size), key in zip(layers, keys, strict=True):
                    if key not in present and key not in downloads:
                        downloads[key] = pool.submit(
                            self._download, client, ref, layer_digest, key, size, progress, stop, headroom
                        )
                try:
                    lowers: list[Path] = []
                    for (layer_digest, layer_size), key in zip(layers, keys, strict=True):
                        layer_dir = self.root / "layers" / key
                        if key in downloads:
                            blob = downloads[key].result()
                            if blob is not None:
                                self._unpack(key, blob, layer_dir, lowers, budget)
                                fetched += 1
                                downloaded += layer_size or 0
                        else:
                            budget.take(self._unpacked_size(key), written=False)
                        progress.unpacked(layer_digest)
                        lowers.insert(0, layer_dir)
                        client.check_deadline()
                except BaseException:
                    stop.set()
                    for future in downloads.values():
                        future.cancel()
                    raise
        finally:  # blobs downloaded but never unpacked (a layer below failed)
            for future in downloads.values():
                if future.done() and not future.cancelled() and future.exception() is None:
                    if (left := future.result()) is not None:
                        left.unlink(missing_ok=True)
        with self._flock(f"image-{digest.split(':', 1)[1]}"):  # a tag and its digest may be pulled at once
            # Registered meanwhile: its top may be in use, never replace it.
            pulled = self.get(digest) or self._register(
                ref,
                digest,
                [d for d, _ in layers],
                keys,
                config,
                sum(s or 0 for _, s in layers),
                budget.bytes,
            )
        self._record_tag(ref, digest)
        return dataclasses.replace(pulled, fetched=fetched, downloaded=downloaded)

    def _remove_unheld(self, keys: list[str]) -> None:
        """After a failed pull: remove each of its layers that no recorded image has and
        no other pull holds (the last pull to let go of a layer removes it)."""
        for key in dict.fromkeys(keys):
            fd = os.open(self.root / "locks" / f"hold-{key}", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # another pull uses it: it records it, or removes it when it fails
                if key not in {k for image in self.all() for k in image.dirs}:
                    (self.root / "layers" / f"{key}.json").unlink(missing_ok=True)
                    _discard(self.root / "layers" / key)
            finally:
                os.close(fd)

    def _layer_ready(self, key: str) -> bool:
        return (self.root / "layers" / f"{key}.json").exists()

    def _unpacked_size(self, key: str) -> int:
        try:
            return int(json.loads((self.root / "layers" / f"{key}.json").read_text())["unpacked"])
        except (OSError, ValueError, KeyError):
            return 0

    def _check_space(self, needed: int, ref: references.Reference) -> None:
        free = disk.free(self.root)
        # the blobs, then unpacked (usually 2-3x)
        why = disk.shortfall(
            free, reserve_bytes=self.reserve, reserve_inodes=self.reserve_inodes, more_bytes=needed * 3
        )
        if why is not None:
            raise errors.LimitExceeded(
                f"not enough disk space to pull {ref}: {needed} bytes to download, {why}; "
                "prune images (`sbx image prune`)"
            )

    def _download(
        self,
        client: registry.Client,
        ref: references.Reference,
        digest: str,
        key: str,
        size: int | None,
        progress: Progress,
        stop: threading.Event,
        headroom: disk.Headroom,
    ) -> Path | None:
        """The blob in a temporary file, or None if another process unpacked it meanwhile."""
        with self._flock(f"layer-{key}"):
            if self._layer_ready(key) or stop.is_set():
                return None
            blob = self.root / "blobs" / f"{key}.{os.getpid()}.{threading.get_ident()}"

            def advanced(count: int) -> None:
                if stop.is_set():
                    raise errors.Cancelled("the pull stopped")
                client.check_deadline()
                headroom(count, 0)
                progress.advanced(digest, count)

            try:
                headroom(0, 1)
                client.fetch_blob(ref, {"digest": digest, "size": size}, blob, advanced, self.max_bytes)
            except BaseException as exc:
                blob.unlink(missing_ok=True)
                if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise errors.LimitExceeded(f"no space left on the device while pulling {ref}") from None
                raise
            return blob

    def _unpack(self, key: str, blob: Path, layer_dir: Path, lowers: list[Path], budget: oci.Budget) -> None:
        tmp = self.root / "layers" / f".{key}.{os.getpid()}.{threading.get_ident()}"
        with self._flock(f"layer-{key}"):
            try:
                if self._layer_ready(key):
                    return
                before = budget.bytes
                _discard(tmp)
                layerfs.unpack_layer(blob, tmp, lowers, budget)
                _discard(layer_dir)  # from a crash between rename and record
                tmp.rename(layer_dir)
                _write_json(
                    self.root / "layers" / f"{key}.json",
                    {"key": key, "size": blob.stat().st_size, "unpacked": budget.bytes - before},
                )
            except BaseException:
                _discard(tmp)
                raise
            finally:
                blob.unlink(missing_ok=True)

    def _register(
        self,
        ref: references.Reference,
        digest: str,
        layers: list[str],
        keys: list[str],
        config: oci.ImageConfig,
        size: int,
        unpacked: int,
    ) -> Pulled:
        hexd = digest.split(":", 1)[1]
        lowers = [self.root / "layers" / key for key in reversed(keys)]
        top = self.root / "manifests" / f"{hexd}.top"
        tmp = top.with_name(f".{hexd}.top.{os.getpid()}.{threading.get_ident()}")
        _discard(tmp)
        try:
            finder = layerfs.LayerExtractor(
                str(tmp), oci.Budget(max_bytes=0, max_members=0), [str(p) for p in lowers]
            )
            tmp.mkdir(mode=0o755)
            _write_top(tmp, finder, config.working_dir)
            _discard(top)
            tmp.rename(top)
        except BaseException:
            _discard(tmp)
            raise
        bash = finder.find("bin/bash") or finder.find("usr/bin/bash")
        sh = finder.find("bin/sh") or finder.find("usr/bin/sh")
        pulled = Pulled(
            reference=str(ref),
            digest=digest,
            layers=tuple(layers),
            config=config,
            size=size,
            unpacked=unpacked,
            trust_store=_is_file(finder, TRUST_STORE),
            has_bash=bash is not None,
            has_sh=sh is not None,
            dirs=tuple(keys),
        )
        _write_json(
            self.root / "manifests" / f"{hexd}.json",
            {
                "reference": pulled.reference,
                "digest": digest,
                "layers": layers,
                "dirs": keys,
                "env": config.env,
                "working_dir": config.working_dir,
                "user": config.user,
                "size": size,
                "unpacked": unpacked,
                "trust_store": pulled.trust_store,
                "has_bash": pulled.has_bash,
                "has_sh": pulled.has_sh,
                "pulled_at": time.time(),
            },
        )
        return pulled

    def _record_tag(self, ref: references.Reference, digest: str) -> None:
        if not ref.pinned:
            _write_json(
                self.root / "tags" / f"{ids.token(str(ref))}.json",
                {"reference": str(ref), "digest": digest, "resolved_at": time.time()},
            )

    # ---- pruning -------------------------------------------------------------------

    def prune(self, in_use: Callable[[], set[str]], keep_bytes: int = 0) -> tuple[list[Pulled], int]:
        """Remove images no sandbox uses, least recently used first, until the layers
        kept take at most ``keep_bytes`` (0: remove every unused one); then every layer
        no image has. Returns the images removed and the bytes freed."""
        with self._flock("store.lock"):
            used = in_use()
            images = sorted(self.all(), key=self.last_used)
            kept_layers = {key for image in images for key in image.dirs}
            total = sum(self._unpacked_size(key) for key in kept_layers)
            removed = []
            for image in images:
                if image.digest in used or (keep_bytes and total <= keep_bytes):
                    continue
                removed.append(image)
                for path in (
                    self.root / "manifests" / f"{image.hex}.json",
                    self.root / "manifests" / f"{image.hex}.top",
                ):
                    _discard(path)
                for tag in (self.root / "tags").glob("*.json"):
                    with contextlib.suppress(OSError, ValueError, KeyError):
                        if json.loads(tag.read_text())["digest"] == image.digest:
                            tag.unlink()
                still = {key for other in self.all() for key in other.dirs}
                total -= sum(self._unpacked_size(key) for key in set(image.dirs) - still)
            wanted = {key for image in self.all() for key in image.dirs}
            freed = 0
            for meta in (self.root / "layers").glob("*.json"):
                if meta.stem not in wanted:
                    freed += self._unpacked_size(meta.stem)
                    _discard(self.root / "layers" / meta.stem)
                    meta.unlink(missing_ok=True)
            self._remove_strays()
            return removed, freed

    def _remove_strays(self) -> None:
        """What crashed pulls left: temporary files, and layers and tops never recorded."""
        for stray in (self.root / "layers").iterdir():
            if stray.name.startswith(".") or (stray.is_dir() and not stray.with_suffix(".json").exists()):
                _discard(stray)
        for stray in (self.root / "manifests").iterdir():
            unrecorded = stray.suffix == ".top" and not stray.with_suffix(".json").exists()
            if stray.name.startswith(".") or unrecorded:
                _discard(stray)
        for stray in (self.root / "blobs").iterdir():
            stray.unlink(missing_ok=True)


def _layer(ref: references.Reference, descriptor: Any) -> tuple[str, int | None]:
    digest, size = registry.descriptor_of(descriptor)
    if size is None:  # (the OCI spec requires it; without it no cap or disk check could hold)
        raise oci.ImageError(f"{ref} has a layer without a size ({digest})")
    media_type = descriptor.get("mediaType")
    if isinstance(media_type, str) and media_type not in LAYER_TYPES:
        if "zstd" in media_type:
            raise oci.ImageError(f"{ref} has zstd-compressed layers, which are not supported yet")
        raise oci.ImageError(f"{ref} has a layer of an unsupported type {media_type!r}")
    return digest, size


def _write_json(path: Path, document: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    try:
        tmp.write_text(json.dumps(document))
        tmp.rename(path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.errno == errno.ENOSPC:
            raise errors.LimitExceeded(f"no space left on the device writing {path.name}") from None
        raise


def _discard(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def _write_top(top: Path, finder: layerfs.LayerExtractor, workdir: str | None) -> None:
    """Mount points, the image's ``WorkingDir``, our ``/etc/hosts``, ``/etc/resolv.conf``
    and ``/etc/hostname``, and the image's ``passwd``/``group`` with the sandbox user
    added where it lacks uid 1000."""
    wanted = dict(TOP_DIRS)
    if workdir and workdir.startswith("/"):
        rel = oci.clean_member_name(workdir.lstrip("/"))
        if rel and finder.find(rel) is None:
            wanted[rel] = 0o755
    for rel, mode in wanted.items():
        path = top / rel
        path.mkdir(parents=True, exist_ok=True)
        os.chmod(path, mode | oci.DIR_OWNER)
    (top / bwrap.HOLD.lstrip("/")).touch()
    for name in ("proxy-ca.pem", "ca-bundle.pem"):
        (top / "etc" / "sbx" / name).touch()
    etc = top / "etc"
    (etc / "hosts").write_text("127.0.0.1 localhost sandbox\n::1 localhost\n")
    (etc / "hostname").write_text("sandbox\n")
    (etc / "resolv.conf").write_text("# no network in this sandbox\n")
    uid, user = bwrap.SANDBOX_UID, bwrap.SANDBOX_USER
    for name, line, field_no in (
        ("passwd", f"{user}:x:{uid}:{uid}:sandbox:/home/{user}:/bin/sh\n", 2),
        ("group", f"{user}:x:{uid}:\n", 2),
    ):
        text = _read_layer_file(finder, f"etc/{name}")
        rows = [row.split(":") for row in text.splitlines()]
        if not any(len(r) > field_no and r[0] == "root" for r in rows):
            text = ("root:x:0:0:root:/root:/bin/sh\n" if name == "passwd" else "root:x:0:\n") + text
        if not any(len(r) > field_no and r[field_no] == str(uid) for r in rows):
            text = (text if text.endswith("\n") or not text else text + "\n") + line
        (etc / name).write_text(text)


def _is_file(finder: layerfs.LayerExtractor, rel: str) -> bool:
    """Whether the image has a regular file at ``rel`` (a symlink there is not one: it
    would be resolved on the host)."""
    found = finder.find(rel)
    return found is not None and stat.S_ISREG(found[1].st_mode)


def is_image_file(lowers: Sequence[Path], rel: str) -> bool:
    """Whether the layers ``lowers`` (the nearest first) show a regular file at ``rel``."""
    return _is_file(
        layerfs.LayerExtractor("", oci.Budget(max_bytes=0, max_members=0), [str(p) for p in lowers]), rel
    )


def read_image_file(lowers: Sequence[Path], rel: str, limit: int = 1024**2) -> str:
    """The text of the regular file ``rel`` as the layers ``lowers`` (the nearest first)
    show it, never through a symlink (an image's ``etc/passwd`` or ``etc`` may point
    anywhere on the host); empty if there is none."""
    finder = layerfs.LayerExtractor("", oci.Budget(max_bytes=0, max_members=0), [str(p) for p in lowers])
    return _read_layer_file(finder, rel, limit)


def _read_layer_file(finder: layerfs.LayerExtractor, rel: str, limit: int = 1024**2) -> str:
    found = finder.find(rel)
    if found is None or not stat.S_ISREG(found[1].st_mode) or found[1].st_size > limit:
        return ""
    try:
        fd = os.open(found[0], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return ""
    with os.fdopen(fd, "rb") as handle:
        data = handle.read(limit)
    return data.decode(errors="replace")
