"""The runtime interface: what the control plane needs from any sandbox backend.

Designed for two shapes of backend. Locally a sandbox is a bubblewrap process tree
with a directory of state; on Kubernetes it is a pod with a PVC, exec goes over the
pods/exec websocket, and ``list`` is a label query. Both fit because the interface
only speaks of ids, specs, statuses and byte streams.

A sandbox outlives the process that created it: a backend must find it again from
its own records (``get``/``list``) after the service restarts.
"""

from __future__ import annotations

import abc
import builtins
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

import msgspec

from sbx_api import errors
from shared.contract import execution

SandboxStatus = Literal["created", "running", "paused", "stopped"]
"""``paused``: running, with every process frozen (see :meth:`Runtime.pause`)."""
Stream = Literal["stdout", "stderr"]

GiB = 1024**3
RUN_MAX_BYTES = 1024**2
"""Most output ``Runtime.run`` collects from one command by default (then it is killed):
a helper's answer is a status or a message; a caller that reads more says how much."""


class Limits(msgspec.Struct, frozen=True, kw_only=True):
    """Resource limits of one sandbox."""

    memory_bytes: int = 2 * GiB
    cpus: float = 1.0
    """CPU time as a number of cores (0.5 = half a core)."""
    pids: int = 512
    """Most processes and threads alive at once."""
    disk_bytes: int = 0
    """Most bytes the sandbox may write to disk (workspace, copy-on-write root, ``/.sbx``);
    0: no limit of its own (local runtime: no filesystem of its own)."""
    disk_inodes: int = 0
    """Most files and directories it may hold on disk (with ``disk_bytes``)."""


OUTPUT_DIR = "/.sbx-out"
"""Where a runtime that can gives each sandbox a small scratch space of its own for the
executor's captured command output (local: a tmpfs of ``OUTPUT_BYTES``)."""
OUTPUT_BYTES = 64 * 1024**2

CACHE_DIR = "/.sbx/cache"
"""Where a sandbox sees its organisation's package cache, on every runtime."""
CACHE_ENV = {
    "XDG_CACHE_HOME": CACHE_DIR,
    "PIP_CACHE_DIR": f"{CACHE_DIR}/pip",
    "UV_CACHE_DIR": f"{CACHE_DIR}/uv",
    "npm_config_cache": f"{CACHE_DIR}/npm",
    "YARN_CACHE_FOLDER": f"{CACHE_DIR}/yarn",
    "GOMODCACHE": f"{CACHE_DIR}/go-mod",
    "GOCACHE": f"{CACHE_DIR}/go-build",
}
"""Where package tools put their caches (each also honours XDG_CACHE_HOME or its own)."""


class SandboxSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What to create. ``sandbox_id`` is chosen by the caller (idempotent create)."""

    sandbox_id: str
    image: str = "default"
    run_as_root: bool = True
    writable_root: bool = True
    isolation: Literal["standard", "strong"] = "standard"
    """``strong`` asks for a VM-class or user-space-kernel backend (gVisor, Kata)."""
    limits: Limits = Limits()
    labels: dict[str, str] = {}
    """Free-form labels (session, pool) used to find sandboxes again."""
    cache: str | None = None
    """The package cache (an organisation's token) the sandbox shows at ``/.sbx/cache``
    from its start; set only where ``Runtime.tenant_caches``. Runtimes whose sandboxes
    cannot take one later (Kubernetes: a pod's volumes are fixed) need it here."""
    snapshot: str | None = None
    """Start from this snapshot (``Runtime.snapshot``): its files are shown read-only below
    the sandbox's own writes (nothing copied), so the sandbox begins where the snapshot's
    sandbox was. ``image``, ``run_as_root`` and ``writable_root`` must be the snapshot's."""


class SandboxInfo(msgspec.Struct, frozen=True, kw_only=True):
    spec: SandboxSpec
    status: SandboxStatus
    created_at: datetime
    backend: str
    """Which backend holds it (``local``, ``kubernetes``)."""
    image_digest: str | None = None
    """The manifest digest of the image it runs, where the backend knows it (local: the
    digest its image's tag was resolved to when it was created; it keeps that one)."""

    @property
    def sandbox_id(self) -> str:
        return self.spec.sandbox_id


class SnapshotInfo(msgspec.Struct, frozen=True, kw_only=True):
    """An immutable copy of a sandbox's files (``/workspace``, its copy-on-write root and
    the shell's saved state), made of content-addressed layers shared with other snapshots."""

    snapshot_id: str
    sandbox_id: str
    """The sandbox it was taken of."""
    digest: str
    """``sha256:…`` of its content (its layers, in order): equal files, equal digest."""
    layers: tuple[str, ...]
    """Its layers' digests, bottom first: the layers of the snapshot its sandbox started
    from (if any), then one layer of what the sandbox wrote since."""
    parent: str | None
    """The snapshot its sandbox started from (a fork's or a restored session's), or None."""
    size: int
    """Bytes of its own (top) layer: what it added on disk unless an equal layer existed."""
    total_size: int
    """Bytes of all its layers: what a fork of it shows."""
    files: int
    """Entries (files, directories, links) in its own layer."""
    image: str
    image_digest: str | None
    run_as_root: bool
    writable_root: bool
    created_at: datetime
    frozen_seconds: float
    """How long the sandbox's processes were frozen while its files were copied (0 for a
    stopped sandbox)."""


Usage = execution.Usage
USAGE_WINDOW = 0.2
"""Seconds between the two readings of CPU time a usage figure is taken over."""


@dataclass(frozen=True)
class PulledImage:
    """An image made available on a backend's machine."""

    reference: str
    """Its normalised reference (``docker.io/library/python:3.12``)."""
    digest: str
    size: int
    """Bytes of its layers (compressed, as downloaded)."""
    layers: int
    fetched: int
    """Layers downloaded now (the rest were in the store already)."""
    downloaded: int
    """Bytes of those layers."""
    seconds: float


@dataclass(frozen=True)
class ExecResult:
    exit_code: int
    """The process's exit status; 128+N when killed by signal N; -1 when it timed out."""
    timed_out: bool = False
    duration: float = 0.0


class Exec(abc.ABC):
    """A running command: iterate ``chunks()`` for output as it comes, then ``wait()``."""

    @abc.abstractmethod
    def chunks(self) -> AsyncIterator[tuple[Stream, bytes]]:
        """Output in the order it was produced, per stream; ends when the command's
        output is closed."""

    @abc.abstractmethod
    async def wait(self) -> ExecResult:
        """Wait for the exit status (after draining ``chunks()``, or without reading; a
        backend may read only so far ahead of ``chunks()``, the local one 4 MiB, so a
        command with more output than that waits for its reader)."""

    @abc.abstractmethod
    async def kill(self) -> None:
        """Kill the command and everything it started."""

    async def exited(self) -> ExecResult:
        """The exit status as soon as the command's own process has ended, even while
        processes it left behind (a daemon, ``cmd &``) still hold its output open."""
        return await self.wait()

    def detach(self) -> None:  # noqa: B027 - optional: backends that can, do
        """Stop reading the command's output: processes it left behind get EPIPE on
        their next write, and nothing waits for them any more."""

    async def send(self, data: bytes) -> None:
        """Write to the command's stdin (only when started with ``keep_stdin_open``).
        Raises Unavailable once the command no longer reads its stdin."""
        raise errors.NotBuiltYet(f"{type(self).__name__} does not support writing to stdin")

    async def close_stdin(self) -> None:  # noqa: B027 - optional, like send()
        """Close the command's stdin, so it reads end-of-file."""


class Runtime(abc.ABC):
    """One sandbox backend. Every method is idempotent where the name suggests it."""

    name: str
    egress: str = "none"
    """How sandboxes reach the network: ``none`` or ``proxy`` (only the credential proxy)."""
    pinned_proxies: bool = False
    """Whether each sandbox reaches only the one proxy the proxy-scaler assigns it (local),
    so it has no way out until it is assigned; else it reaches the fleet through a
    load-balanced address (Kubernetes: the proxies' Service)."""

    async def image_present(self, image: str) -> bool:
        """Whether ``image`` can start a sandbox without a pull first (a backend whose
        nodes pull on their own, as Kubernetes's kubelets do, says True)."""
        return True

    async def pull(self, image: str, *, refresh: bool = False) -> PulledImage | None:
        """Fetch ``image`` from its registry unless it is here (``refresh``: resolve its
        tag again). None where there is nothing to fetch (a built-in or registered image,
        or a backend whose nodes pull). Raises a SandboxError saying why a pull failed."""
        return None

    @abc.abstractmethod
    async def create(self, spec: SandboxSpec) -> SandboxInfo:
        """Prepare a sandbox (storage, image) without running anything. Creating an id
        that exists with the same spec returns it; with a different spec raises Conflict."""

    @abc.abstractmethod
    async def start(self, sandbox_id: str) -> SandboxInfo:
        """Run it (no-op if running). Raises NotFound for an unknown id."""

    @abc.abstractmethod
    async def stop(self, sandbox_id: str) -> SandboxInfo:
        """Kill every process in it; keep its storage (no-op if stopped)."""

    @abc.abstractmethod
    async def delete(self, sandbox_id: str) -> None:
        """Stop it and remove its storage. Deleting an unknown id is a no-op."""

    @abc.abstractmethod
    async def get(self, sandbox_id: str) -> SandboxInfo | None: ...

    @abc.abstractmethod
    async def list(self, labels: Mapping[str, str] | None = None) -> list[SandboxInfo]:
        """Every sandbox this backend holds (matching all ``labels``): the reconcile input."""

    @abc.abstractmethod
    async def exec(
        self,
        sandbox_id: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | None = None,
        timeout: float | None = None,
        keep_stdin_open: bool = False,
    ) -> Exec:
        """Start ``argv`` inside a running sandbox. Output streams as it comes; on timeout
        the command's processes are killed and the result says ``timed_out``. ``stdin``
        is written, then stdin is closed, unless ``keep_stdin_open``: then ``Exec.send``
        writes more and ``Exec.close_stdin`` ends it (a long-lived helper process).
        Raises NotFound for an unknown id and NotRunning if the sandbox is not running."""

    pausable: bool = False
    """Whether :meth:`pause` and :meth:`resume` work here."""
    pause_keeps_processes: bool = True
    """Whether a paused sandbox's processes go on where they were when it resumes (local:
    frozen in memory), or only its files are kept (Kubernetes: scaled to zero, its claim
    kept; the processes start over)."""

    async def pause(self, sandbox_id: str) -> SandboxInfo:
        """Freeze every process of the running sandbox where it is: memory kept, no CPU
        time, nothing enters it until :meth:`resume` (``exec`` raises NotRunning). No-op if
        paused. Raises NotRunning if it is not running, NotBuiltYet where it cannot be done."""
        raise errors.NotBuiltYet(f"pausing a sandbox is not available on the {self.name} runtime yet")

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        """Let a paused sandbox's processes go on (no-op if running; ``start`` also resumes)."""
        raise errors.NotBuiltYet(f"resuming a paused sandbox is not available on the {self.name} runtime yet")

    async def paused(self, sandbox_id: str) -> bool:
        """Whether the sandbox is paused (cheap: callers ask before using a helper they keep)."""
        return False

    snapshots: bool = False
    """Whether :meth:`snapshot` and ``SandboxSpec.snapshot`` work here."""

    async def snapshot(self, sandbox_id: str, snapshot_id: str) -> SnapshotInfo:
        """Copy the sandbox's files as snapshot ``snapshot_id``, consistently: a running
        sandbox's processes are frozen while its files are copied and thawed after (a
        paused one stays paused; a stopped one is copied as it is). Idempotent: an existing
        ``snapshot_id`` of the same sandbox is returned as it is. Raises NotFound for an
        unknown sandbox, LimitExceeded when the snapshot store's budget would be passed,
        NotBuiltYet where snapshots cannot be made."""
        raise errors.NotBuiltYet(f"snapshots are not available on the {self.name} runtime yet")

    async def get_snapshot(self, snapshot_id: str) -> SnapshotInfo | None:
        return None

    async def list_snapshots(self) -> builtins.list[SnapshotInfo]:
        return []

    async def delete_snapshot(self, snapshot_id: str) -> bool:
        """Forget the snapshot (True if it existed). Its layers stay while a sandbox started
        from it, or another snapshot, still uses them: deleting never breaks a fork."""
        return False

    def snapshot_bytes(self) -> int:
        """Bytes the snapshot store holds on disk (every layer once)."""
        return 0

    async def usage(self, sandbox_id: str, *, window: float = USAGE_WINDOW) -> Usage:
        """What the running sandbox uses now: CPU (over ``window`` seconds), memory and
        disk, with its limits. NotRunning if it does not run (or is paused)."""
        raise errors.NotBuiltYet(f"resource usage is not read by the {self.name} runtime yet")

    tenant_caches: bool = False
    """Whether :meth:`attach_cache` works here."""

    async def attach_cache(self, sandbox_id: str, key: str) -> bool:
        """Show the package cache ``key`` (an organisation's token) in the running sandbox
        at ``/.sbx/cache``, where ``XDG_CACHE_HOME``, ``PIP_CACHE_DIR``, ``npm_config_cache``
        and friends point. True if attached now, False if it already was. A sandbox shows
        at most one organisation's cache, ever (another key: Conflict)."""
        raise errors.NotBuiltYet(f"per-tenant package caches are not built for the {self.name} runtime yet")

    async def close(self) -> None:  # noqa: B027 - optional: backends with clients override it
        """Release what the backend holds open (API clients); sandboxes are not touched."""

    async def run(
        self,
        sandbox_id: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | None = None,
        timeout: float | None = None,
        max_bytes: int = RUN_MAX_BYTES,
    ) -> tuple[ExecResult, bytes, bytes]:
        """Convenience: run to completion and collect stdout and stderr. What comes from
        inside a sandbox is untrusted: past ``max_bytes`` of output in all, the command
        is killed and LimitExceeded raised, so no caller ever holds more."""
        running = await self.exec(sandbox_id, argv, env=env, cwd=cwd, stdin=stdin, timeout=timeout)
        out: list[bytes] = []
        err: list[bytes] = []
        total = 0
        async for stream, data in running.chunks():
            total += len(data)
            if total > max_bytes:
                await running.kill()
                raise errors.LimitExceeded(
                    f"a helper command in the sandbox wrote more than {max_bytes} bytes; it was killed"
                )
            (out if stream == "stdout" else err).append(data)
        return await running.wait(), b"".join(out), b"".join(err)


SandboxNotRunning = errors.NotRunning
