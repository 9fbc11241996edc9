"""What a local sandbox's directory records about it, besides its spec: its running init
(``state.json``), what it was made from (``image.json``) and, for one from a snapshot,
what it stands on (``base.json``). Unreadable records read as absent or as defaults."""

from __future__ import annotations

from pathlib import Path

import msgspec

from shared.runtime.local import bwrap, images


class Running(msgspec.Struct):
    """The sandbox's init while it runs (``state.json``): host pid and start time."""

    pid: int
    starttime: int


class Pin(msgspec.Struct, frozen=True):
    """What a sandbox was made from (``image.json`` in its directory)."""

    digest: str | None = None
    uid: int = bwrap.SANDBOX_UID
    """Who it runs as without ``run_as_root``: the image's ``User`` when that is not root."""
    home: str = bwrap.home(False)
    workdir: str | None = None
    env: dict[str, str] = {}


_pin_decoder = msgspec.json.Decoder(Pin)


class Base(msgspec.Struct, frozen=True, array_like=True):
    """What a sandbox from a snapshot stands on (``base.json``): the snapshot, its layers."""

    snapshot: str | None = None
    layers: tuple[str, ...] = ()


_base_decoder = msgspec.json.Decoder(Base)


def base_of(d: Path) -> Base:
    try:
        return _base_decoder.decode((d / "base.json").read_bytes())
    except (OSError, msgspec.DecodeError):
        return Base()


def pin_of(d: Path) -> Pin:
    try:
        return _pin_decoder.decode((d / "image.json").read_bytes())
    except (OSError, msgspec.DecodeError):
        return Pin()


def write_pin(d: Path, image: images.Image) -> None:
    config = image.config
    env = {}
    for item in config.env if config else ():
        key, sep, value = item.partition("=")
        if sep and key and key not in ("HOME", "HOSTNAME"):
            env[key] = value
    uid, home = images.user_of(image)
    workdir = config.working_dir if config else None
    if not (workdir and workdir.startswith("/")):
        workdir = None
    (d / "image.json").write_bytes(
        msgspec.json.encode(
            Pin(
                digest=image.digest,
                uid=uid,
                home=home,
                workdir=workdir,
                env=env,
            )
        )
    )
