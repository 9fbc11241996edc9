"""Images for the local runtime: the built-in ``default`` and registered root filesystems.

``default`` needs no network and no download: the host's system directories
(``/usr`` and the ``/bin``/``/lib`` family), read-only or copy-on-write, under a
synthetic ``/etc`` made of an allowlist of harmless host files plus our own
``passwd``/``group``/``hosts``. Nothing from ``/root``, ``/home``, ``/etc/shadow``,
``/etc/ssh``, other secrets or the state directory is ever shown.

Registered images are root filesystem directories, registered by name, either given
as a directory or unpacked from a ``docker save`` / OCI layout archive (``oci.unpack``).

Any other name is an OCI reference (``python:3.12-slim``, ``ghcr.io/org/img@sha256:...``),
pulled from its registry into the layer store (``layers.py``) and shown as its layers
stacked under one overlay. A registered name is looked up before a registry is asked.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sbx_api import errors
from shared.contract import ids, references
from shared.runtime.local import bwrap, fdtree, layers, oci

DEFAULT = "default"
SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
#: Host /etc entries a sandbox may see: linker config, certificates, locale and shell
#: defaults. No credentials, keys, user databases or service configuration.
ETC_ALLOW = (
    "alternatives", "bash.bashrc", "ca-certificates", "ca-certificates.conf", "debian_version",
    "dpkg", "inputrc", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "login.defs",
    "magic", "magic.mime", "mime.types", "os-release", "profile", "profile.d", "protocols",
    "python3", "python3.11", "services", "shells", "ssl", "timezone",
)  # fmt: skip
_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")


@dataclass(frozen=True)
class Image:
    name: str
    layers: tuple[bwrap.Layer, ...]
    symlinks: tuple[tuple[str, str], ...] = ()
    dirs: tuple[str, ...] = ()
    config: oci.ImageConfig | None = None
    """What the image declares (``Env``, ``WorkingDir``, ``User``); None for ``default``."""
    digest: str | None = None
    """The manifest digest of a pulled image."""
    trust_store: bool = False
    """Whether it has ``/etc/ssl/certs/ca-certificates.crt`` (shown with the proxy's CA added)."""


def _synthetic_etc(target: Path) -> None:
    """Write the default image's /etc template once. Running sandboxes use it as an
    overlay lower layer, so an existing one is never rewritten in place."""
    if target.exists():
        return
    tmp = target.with_name(f"{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in ETC_ALLOW:
        source = Path("/etc") / name
        if source.is_symlink():
            os.symlink(os.readlink(source), tmp / name)
        elif source.is_dir():
            shutil.copytree(source, tmp / name, symlinks=True, ignore_dangling_symlinks=True)
        elif source.is_file():
            shutil.copy2(source, tmp / name)
    uid = bwrap.SANDBOX_UID
    (tmp / "passwd").write_text(
        "root:x:0:0:root:/root:/bin/bash\n"
        f"{bwrap.SANDBOX_USER}:x:{uid}:{uid}:sandbox:/home/{bwrap.SANDBOX_USER}:/bin/bash\n"
        "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
    )
    (tmp / "group").write_text(f"root:x:0:\n{bwrap.SANDBOX_USER}:x:{uid}:\nnogroup:x:65534:\n")
    (tmp / "hosts").write_text("127.0.0.1 localhost sandbox\n::1 localhost\n")
    (tmp / "hostname").write_text("sandbox\n")
    (tmp / "resolv.conf").write_text("# no network in this sandbox\n")
    (tmp / "nsswitch.conf").write_text("passwd: files\ngroup: files\nhosts: files dns\n")
    # Mount points for the proxy's CA (egresslinks.CA_DIR): bwrap binds the files onto them,
    # which a read-only root (writable_root=false) could not create.
    (tmp / "sbx").mkdir()
    for name in ("proxy-ca.pem", "ca-bundle.pem"):
        (tmp / "sbx" / name).touch()
    try:
        tmp.rename(target)
    except OSError:  # another process built it first
        shutil.rmtree(tmp, ignore_errors=True)


def user_of(image: Image) -> tuple[int, str]:
    """Who a sandbox of ``image`` runs as when not root: the uid and home of the image's
    ``User`` if that names someone other than root (a number, or a name in its
    ``/etc/passwd``), else our sandbox user (uid 1000)."""
    fallback = (bwrap.SANDBOX_UID, bwrap.home(False))
    wanted = (image.config.user or "").split(":", 1)[0] if image.config else ""
    if not wanted or wanted in ("0", "root"):
        return fallback
    rows = []
    if image.layers and image.layers[0].dest == "/":  # (the image's files: read by descriptor, ``etc``
        # or ``passwd`` a link would otherwise be resolved on the host)
        found = fdtree.read_file(image.layers[0].source, ("etc", "passwd"), 1024**2)
        if found is not None:
            rows = [row.split(":") for row in found[0].decode(errors="replace").splitlines()]
    for row in rows:
        if len(row) >= 6 and wanted in (row[0], row[2]) and _uid(row[2]) is not None:
            return _uid(row[2]) or 0, row[5] or fallback[1]
    if (uid := _uid(wanted)) is not None:
        return uid, fallback[1]
    return fallback


def _uid(text: str) -> int | None:
    """A non-root uid written in ASCII digits (``00`` is root; so are other scripts' zeros)."""
    if not (text.isascii() and text.isdigit()) or not 0 < int(text) < 2**31:
        return None
    return int(text)


class ImageStore:
    """Registered images under ``<state>/images/<name>/``; pulled ones in ``layers``."""

    def __init__(self, root: Path, pulled: layers.LayerStore | None = None) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self.pulled = pulled or layers.LayerStore(root)
        self._default: Image | None = None

    def default(self) -> Image:
        if self._default is None:
            etc = self.root / DEFAULT / "etc"
            _synthetic_etc(etc)
            layers_: list[bwrap.Layer] = []
            symlinks: list[tuple[str, str]] = []
            for name in SYSTEM_DIRS:
                host = Path("/") / name
                if host.is_symlink():
                    symlinks.append((os.readlink(host), f"/{name}"))
                elif host.is_dir():
                    layers_.append(bwrap.Layer(host, f"/{name}"))
            layers_.append(bwrap.Layer(etc, "/etc"))
            self._default = Image(
                DEFAULT,
                tuple(layers_),
                tuple(symlinks),
                ("/root", f"/home/{bwrap.SANDBOX_USER}", "/var/tmp"),
                trust_store=True,
            )
        return self._default

    def registered(self, name: str) -> Image | None:
        """The registered image of that name, if there is one (None for a reference)."""
        record = self._record_of(name)
        if record is None:
            return None
        rootfs = Path(record["rootfs"])
        if not (rootfs / "bin" / "sh").exists() and not (rootfs / "bin" / "sh").is_symlink():
            raise errors.InvalidInput(f"image {name!r} has no /bin/sh; sandboxes need a POSIX shell")
        config = record.get("config")
        return Image(
            name,
            (bwrap.Layer(rootfs, "/"),),
            config=oci.ImageConfig.from_json({"config": config}) if isinstance(config, dict) else None,
            trust_store=(rootfs / layers.TRUST_STORE).is_file()
            and not (rootfs / layers.TRUST_STORE).is_symlink(),
        )

    def resolve(self, name: str, digest: str | None = None) -> Image:
        """The image ``name`` stands for: ``default``, a registered one, or a pulled one
        (``digest``: the one a sandbox is pinned to). A reference not pulled yet is an
        error here: ``LocalRuntime.pull`` fetches it."""
        if name == DEFAULT:
            return self.default()
        if (image := self.registered(name)) is not None:
            return image
        ref = references.parse(name)
        pulled = self.pulled.get(digest) if digest else self.pulled.cached(ref)
        if pulled is None:
            raise errors.NotFound(
                f"image {name!r} is not on this machine yet (the runtime pulls it on first use)"
            )
        return self.of_pulled(name, pulled)

    def of_pulled(self, name: str, pulled: layers.Pulled) -> Image:
        if not pulled.has_sh:
            raise errors.InvalidInput(f"image {name!r} has no /bin/sh; sandboxes need a POSIX shell")
        lower = self.pulled.lower_dirs(pulled)
        return Image(
            name,
            (bwrap.Layer(lower[-1], "/", lower=lower[:-1]),),
            config=pulled.config,
            digest=pulled.digest,
            trust_store=pulled.trust_store,
        )

    def names(self) -> list[str]:
        out = []
        for path in self.root.iterdir():
            if path.name == DEFAULT or not (path / "image.json").exists():
                continue
            with contextlib.suppress(OSError, ValueError, KeyError):
                out.append(str(json.loads((path / "image.json").read_text()).get("name") or path.name))
        return sorted(out)

    @staticmethod
    def _dir_name(name: str) -> str:
        """Simple names keep their own directory; a reference-shaped name gets a token."""
        return name if _NAME.fullmatch(name) else "ref-" + ids.token(str(references.parse(name)))

    def _record_of(self, name: str) -> dict[str, Any] | None:
        try:
            directory = self._dir_name(name)
        except errors.InvalidInput:
            return None
        try:
            record = json.loads((self.root / directory / "image.json").read_text())
            Path(record["rootfs"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return record if isinstance(record, dict) else None

    def add_rootfs(self, name: str, rootfs: Path) -> None:
        """Register an existing root filesystem directory (used in place, never modified)."""
        self._check_name(name)
        rootfs = rootfs.resolve()
        if not (rootfs / "bin" / "sh").exists():
            raise errors.InvalidInput(f"{rootfs} has no bin/sh; is it a root filesystem?")
        self._record(name, rootfs, source=str(rootfs))

    def import_archive(
        self, name: str, archive: Path, progress: Callable[[int, int], None] | None = None
    ) -> None:
        """Unpack a ``docker save`` or OCI layout archive and register it (``progress``:
        see ``oci.unpack``)."""
        self._check_name(name)
        dest = self.root / self._dir_name(name) / "rootfs"
        if dest.exists():
            shutil.rmtree(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        config = oci.unpack(archive, dest, progress=progress)
        self._record(name, dest, source=str(archive), config=config)

    def _check_name(self, name: str) -> None:
        if name == DEFAULT:
            raise errors.InvalidInput(f"{DEFAULT!r} is the built-in image; choose another name")
        references.parse(name)  # a name is anything an image reference may be

    def _record(self, name: str, rootfs: Path, *, source: str, config: oci.ImageConfig | None = None) -> None:
        directory = self.root / self._dir_name(name)
        directory.mkdir(parents=True, exist_ok=True)
        record: dict[str, Any] = {"name": name, "rootfs": str(rootfs), "source": source}
        if config is not None:
            record["config"] = {"Env": config.env, "WorkingDir": config.working_dir, "User": config.user}
        (directory / "image.json").write_text(json.dumps(record))
