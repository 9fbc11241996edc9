"""The sandboxes' state directory: one directory per sandbox under ``<state>/sandboxes/``,
named by a token of its id (never the raw id), and what its records say about it.

A sandbox's directory holds ``spec.json`` (what was asked, and when), ``state.json``
(its running init, ``records.Running``), ``started`` (it ran once), ``image.json`` and
``base.json`` (``records.py``). Its status is read from them and from its cgroup's
freezer: nothing else is kept, so any process with the same state directory finds it.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path

import msgspec

from sbx_api import errors
from shared.contract import ids
from shared.infrastructure import processes
from shared.runtime import api
from shared.runtime.local import cgroups, disk, records


def cgroup_name(sandbox_id: str) -> str:
    """The sandbox's cgroup (the same token as its directory's name)."""
    return f"sbx-{ids.token(sandbox_id)}"


def status_of(*, running: bool, frozen: bool, started: bool) -> api.SandboxStatus:
    """A sandbox's status from what its records and its cgroup say."""
    if running:
        return "paused" if frozen else "running"
    return "stopped" if started else "created"


class SandboxDirs:
    """The sandboxes' directories under ``root`` and the records in them."""

    def __init__(self, root: Path, backend: str, host_cgroups: cgroups.HostCgroups) -> None:
        self.root = root
        self.backend = backend
        self.host_cgroups = host_cgroups
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)

    def dir(self, sandbox_id: str) -> Path:
        return self.root / ids.token(sandbox_id)

    def frozen(self, d: Path) -> bool:
        """Whether the sandbox of directory ``d`` is frozen (or being frozen)."""
        return self.host_cgroups.frozen(f"sbx-{d.name}")

    @staticmethod
    def read_spec(d: Path) -> tuple[api.SandboxSpec, datetime] | None:
        try:
            raw = json.loads((d / "spec.json").read_text())
        except (OSError, ValueError):
            return None
        return msgspec.convert(raw["spec"], api.SandboxSpec), datetime.fromisoformat(raw["created_at"])

    @staticmethod
    def write_spec(d: Path, spec: api.SandboxSpec) -> datetime:
        """Record what was asked, now; when that was."""
        created_at = datetime.now(UTC)
        record = {"spec": msgspec.to_builtins(spec), "created_at": created_at.isoformat()}
        (d / "spec.json").write_text(json.dumps(record))
        return created_at

    @staticmethod
    def running(d: Path) -> records.Running | None:
        """Its init while it runs: the recorded pid, if that process is still the one started."""
        try:
            running = msgspec.json.decode((d / "state.json").read_bytes(), type=records.Running)
        except (OSError, msgspec.DecodeError):
            return None
        return running if processes.start_time(running.pid) == running.starttime else None

    def info(self, d: Path, pin: records.Pin | None = None) -> api.SandboxInfo | None:
        record = self.read_spec(d)
        if record is None:
            return None
        spec, created_at = record
        running = self.running(d) is not None
        return api.SandboxInfo(
            spec=spec,
            status=status_of(
                running=running,
                frozen=running and self.frozen(d),
                started=not running and (d / "started").exists(),
            ),
            created_at=created_at,
            backend=self.backend,
            image_digest=(pin or records.pin_of(d)).digest,
        )

    def get(self, sandbox_id: str) -> api.SandboxInfo | None:
        return self.info(self.dir(sandbox_id))

    def require(self, sandbox_id: str) -> api.SandboxInfo:
        info = self.get(sandbox_id)
        if info is None:
            raise errors.NotFound(f"sandbox {sandbox_id!r} does not exist")
        return info

    def list(self, labels: Mapping[str, str] | None = None) -> list[api.SandboxInfo]:
        out = []
        for d in sorted(self.root.iterdir()):
            info = self.info(d)
            if info is not None and all(info.spec.labels.get(k) == v for k, v in (labels or {}).items()):
                out.append(info)
        return out

    def all(self) -> Iterator[Path]:
        """Every directory here, sandboxes being made and being deleted included."""
        return self.root.iterdir()

    def image_users(self) -> dict[str, int]:
        """How many sandboxes here (or being made) are pinned to each pulled image's digest."""
        users: dict[str, int] = {}
        for d in self.all():
            if (digest := records.pin_of(d).digest) is not None:
                users[digest] = users.get(digest, 0) + 1
        return users

    def layers_in_use(self) -> set[str]:
        """The snapshot layers some sandbox here stands on (those being made too: their
        ``base.json`` is written before they are)."""
        found: set[str] = set()
        for d in self.all():
            found.update(records.base_of(d).layers)
        return found

    @staticmethod
    def discard(directory: Path) -> None:
        """Remove a sandbox directory, its own filesystem detached first (never emptied)."""
        disk.Disk.unmount(directory)
        shutil.rmtree(directory, ignore_errors=True)
