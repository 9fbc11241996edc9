"""What the client remembers between calls, so an unchanged tree costs one ``lstat`` per
file and no transfer: per session and code dir, the sandbox it was synced with, the
host manifest that went up, the sandbox's listing after the last command, and the
digest cache. Kept in memory by a ``Sandbox``, and on disk (``$SBX_CLIENT_STATE_DIR``,
default ``~/.local/state/sbx-client``) for sessions kept across ``sbx exec --keep`` calls.

A record for another sandbox (the session's sandbox was replaced or reaped) is ignored:
the next round sends everything again.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from sbx_api import hostapi
from sbx_client import sync

VERSION = 2  # 2: entries and listings as arrays (msgspec structs)


@dataclass
class Tree:
    """One host tree and its copy in the sandbox."""

    sandbox_root: str
    host: dict[str, sync.Entry] = field(default_factory=dict)
    sandbox: dict[str, hostapi.Stat] = field(default_factory=dict)
    extra: dict[str, str] = field(default_factory=dict)
    """Digests of generated files that went up (rendered git configs)."""
    digests: dict[str, tuple[tuple[int, int, int], str]] = field(default_factory=dict)
    """The scan's digest cache (:func:`sync.scan`)."""


@dataclass
class Record:
    version: int = VERSION
    sandbox_id: str = ""
    trees: dict[str, Tree] = field(default_factory=dict)
    """By host path."""


def state_dir(env: Mapping[str, str]) -> Path:
    if env.get("SBX_CLIENT_STATE_DIR"):
        return Path(env["SBX_CLIENT_STATE_DIR"])
    base = env.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "sbx-client"


def path_for(directory: Path, url: str, session: str, code_dir: Path) -> Path:
    key = hashlib.blake2b(f"{url}\0{session}\0{code_dir}".encode(), digest_size=16).hexdigest()
    return directory / "sessions" / f"{key}.msgpack"


def load(path: Path) -> Record:
    try:
        record = msgspec.msgpack.decode(path.read_bytes(), type=Record)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return Record()
    return record if record.version == VERSION else Record()


def save(path: Path, record: Record) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    temporary = path.with_suffix(f".{os.getpid()}.tmp")
    temporary.write_bytes(msgspec.msgpack.encode(record))
    os.replace(temporary, path)


def forget(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
