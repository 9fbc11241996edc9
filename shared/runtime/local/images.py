"""Images for the local runtime: the built-in ``default`` and registered root filesystems.

``default`` needs no network and no download: the host's system directories
(``/usr`` and the ``/bin``/``/lib`` family), read-only or copy-on-write, under a
synthetic ``/etc`` made of an allowlist of harmless host files plus our own
``passwd``/``group``/``hosts``. Nothing from ``/root``, ``/home``, ``/etc/shadow``,
``/etc/ssh``, other secrets or the state directory is ever shown.

Other images are root filesystem directories, registered by name, either given as a
directory or unpacked from a ``docker save`` / OCI layout archive (``oci.unpack``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from shared.contract import errors
from shared.runtime.local import bwrap

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


def _synthetic_etc(target: Path) -> None:
    """Write the default image's /etc template once. Running sandboxes use it as an
    overlay lower layer, so an existing one is never rewritten in place."""
    if target.exists():
        return
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
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
    # Mount points for the proxy's CA (runtime.CA_DIR): bwrap binds the files onto them,
    # which a read-only root (writable_root=false) could not create.
    (tmp / "sbx").mkdir()
    for name in ("proxy-ca.pem", "ca-bundle.pem"):
        (tmp / "sbx" / name).touch()
    try:
        tmp.rename(target)
    except OSError:  # another process built it first
        shutil.rmtree(tmp, ignore_errors=True)


class ImageStore:
    """Registered images under ``<state>/images/<name>/``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self._default: Image | None = None

    def default(self) -> Image:
        if self._default is None:
            etc = self.root / DEFAULT / "etc"
            _synthetic_etc(etc)
            layers: list[bwrap.Layer] = []
            symlinks: list[tuple[str, str]] = []
            for name in SYSTEM_DIRS:
                host = Path("/") / name
                if host.is_symlink():
                    symlinks.append((os.readlink(host), f"/{name}"))
                elif host.is_dir():
                    layers.append(bwrap.Layer(host, f"/{name}"))
            layers.append(bwrap.Layer(etc, "/etc"))
            self._default = Image(
                DEFAULT, tuple(layers), tuple(symlinks), ("/root", f"/home/{bwrap.SANDBOX_USER}", "/var/tmp")
            )
        return self._default

    def resolve(self, name: str) -> Image:
        if name == DEFAULT:
            return self.default()
        rootfs = self._rootfs(name)
        if rootfs is None:
            known = ", ".join([DEFAULT, *self.names()])
            raise errors.InvalidInput(
                f"unknown image {name!r}: this local runtime knows {known}. Register one with "
                "`sbx image import NAME ARCHIVE.tar` or `sbx image add NAME ROOTFS_DIR`; pulling from "
                "registries is not built yet"
            )
        for needed in ("bin/sh",):
            if not (rootfs / needed).exists() and not (rootfs / needed).is_symlink():
                raise errors.InvalidInput(f"image {name!r} has no /{needed}; sandboxes need a POSIX shell")
        return Image(name, (bwrap.Layer(rootfs, "/"),))

    def names(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if p.name != DEFAULT and self._rootfs(p.name))

    def _rootfs(self, name: str) -> Path | None:
        if not _NAME.fullmatch(name):
            return None
        meta = self.root / name / "image.json"
        try:
            return Path(json.loads(meta.read_text())["rootfs"])
        except (OSError, ValueError, KeyError):
            return None

    def add_rootfs(self, name: str, rootfs: Path) -> None:
        """Register an existing root filesystem directory (used in place, never modified)."""
        self._check_name(name)
        rootfs = rootfs.resolve()
        if not (rootfs / "bin" / "sh").exists():
            raise errors.InvalidInput(f"{rootfs} has no bin/sh; is it a root filesystem?")
        self._record(name, rootfs, source=str(rootfs))

    def import_archive(self, name: str, archive: Path) -> None:
        """Unpack a ``docker save`` or OCI layout archive and register it."""
        from shared.runtime.local import oci

        self._check_name(name)
        dest = self.root / name / "rootfs"
        if dest.exists():
            shutil.rmtree(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        oci.unpack(archive, dest)
        self._record(name, dest, source=str(archive))

    def _check_name(self, name: str) -> None:
        if name == DEFAULT or not _NAME.fullmatch(name):
            raise errors.InvalidInput(
                f"image name {name!r} must be 1-64 of a-z 0-9 . _ - (and not {DEFAULT!r})"
            )

    def _record(self, name: str, rootfs: Path, *, source: str) -> None:
        (self.root / name).mkdir(parents=True, exist_ok=True)
        (self.root / name / "image.json").write_text(json.dumps({"rootfs": str(rootfs), "source": source}))
