"""``sbx image``: pull, list and prune the images of the local runtime's layer store.

A pull runs here, into the state directory's store, with a progress bar; when a stack
is up for that state directory, the pull is recorded in its event stream as the
pool-manager records its own (``image.pull_started``, ``image.pulled`` /
``image.pull_failed``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sbx import bars
from sbx_api import errors
from sbx_client import terminal
from shared.contract import events, ids, references
from shared.domain import describe
from shared.infrastructure.settings import runtime as runtime_settings
from shared.runtime import backends

DEFAULT = "default"


def open_local(state_dir: Path, env: dict[str, str]) -> Any:
    """The local runtime of ``state_dir`` (a ``LocalRuntime``, reached through backends)."""
    return backends.image_runtime("local", state_dir, runtime_settings.RuntimeSettings.from_env(env))


class _Bar:
    """Layers, bytes and rate of a pull, on a rich progress display."""

    def __init__(self) -> None:
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self.display = bars.display(
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
        )
        self._tasks: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._total: Any = None
        self._count = 0
        self._done = 0

    def layers(self, layers_: Any) -> None:
        with self._lock:
            self._count = len(layers_)
            needed = sum(size or 0 for _, size, have in layers_ if not have)
            self._total = self.display.add_task(f"layers 0/{self._count}", total=needed or None)
            for digest, size, have in layers_:
                if have:
                    self._done += 1
                    continue
                self._tasks[digest] = self.display.add_task(f"  {digest[7:19]}", total=size)
            self.display.update(self._total, description=f"layers {self._done}/{self._count}")

    def advanced(self, digest: str, count: int) -> None:
        with self._lock:
            if digest in self._tasks:
                self.display.advance(self._tasks[digest], count)
            if self._total is not None:
                self.display.advance(self._total, count)

    def unpacked(self, digest: str) -> None:
        with self._lock:
            if digest in self._tasks:
                self._done += 1
                self.display.update(self._tasks[digest], description=f"  {digest[7:19]} ready")
                if self._total is not None:
                    self.display.update(self._total, description=f"layers {self._done}/{self._count}")


class _Stoppable:
    """The progress a pull reports, passed on to the bar (if any); raises Cancelled in the
    pull's thread once ``stop`` is set, which ends the pull there (it cleans up as for any
    failure)."""

    def __init__(self, bar: _Bar | None) -> None:
        self.bar = bar
        self.stop = threading.Event()

    def _go_on(self) -> None:
        if self.stop.is_set():
            raise errors.Cancelled("the pull was interrupted")

    def layers(self, layers_: Any) -> None:
        self._go_on()
        if self.bar is not None:
            self.bar.layers(layers_)

    def advanced(self, digest: str, count: int) -> None:
        self._go_on()
        if self.bar is not None:
            self.bar.advanced(digest, count)

    def unpacked(self, digest: str) -> None:
        self._go_on()
        if self.bar is not None:
            self.bar.unpacked(digest)


async def pull(
    state_dir: Path, env: dict[str, str], reference: str, *, refresh: bool, quiet: bool, as_json: bool
) -> int:
    ref = references.parse(reference)  # a bad reference: said before anything else
    runtime = open_local(state_dir, env)
    recorder = await _Recorder.open(state_dir, env)
    await recorder.record(events.ImagePullStarted(meta=recorder.meta(), reference=str(ref)))
    bar = _Bar() if bars.wanted(as_json=as_json, quiet=quiet) else None
    watch = _Stoppable(bar)
    try:
        with bar.display if bar is not None else contextlib.nullcontext():
            pulled = await runtime.pull(reference, refresh=refresh, progress=watch)
    except (errors.SandboxError, asyncio.CancelledError) as exc:
        # Ctrl-C: the pull's threads stop at their next chunk (the interpreter waits for
        # them on its way out: without this, for the rest of the download).
        watch.stop.set()
        failure = exc if isinstance(exc, errors.SandboxError) else errors.Cancelled("interrupted")
        await recorder.record(
            events.ImagePullFailed(
                meta=recorder.meta(), reference=str(ref), error=failure.code, reason=failure.message
            )
        )
        await recorder.close()
        raise
    if pulled is None:
        await recorder.close()
        kind = "built-in" if reference == DEFAULT else "registered"
        nothing = dict.fromkeys(("digest", "size", "layers", "fetched", "seconds"))
        _say(
            {"reference": reference, "kind": kind, "pulled": False, **nothing},
            f"{reference} is {'built in' if kind == 'built-in' else 'a registered image'}: nothing to pull",
            as_json,
        )
        return 0
    await recorder.record(
        events.ImagePulled(
            meta=recorder.meta(),
            reference=pulled.reference,
            digest=pulled.digest,
            size=pulled.size,
            layers=pulled.layers,
            fetched=pulled.fetched,
            seconds=round(pulled.seconds, 3),
        )
    )
    await recorder.close()
    report = {
        "reference": pulled.reference,
        "kind": "pulled",
        "pulled": True,
        "digest": pulled.digest,
        "size": pulled.size,
        "layers": pulled.layers,
        "fetched": pulled.fetched,
        "seconds": round(pulled.seconds, 3),
    }
    text = (
        f"{pulled.reference}@{pulled.digest}: {pulled.layers} layers ({pulled.fetched} downloaded), "
        f"{describe.size(pulled.size)} in {pulled.seconds:.1f}s"
    )
    _say(report, text, as_json)
    return 0


def _say(report: dict[str, Any], text: str, as_json: bool) -> None:
    """A command's one report: ``report`` as one JSON object, or ``text``."""
    print(terminal.json_text(report, indent=2) if as_json else terminal.escape(text))


def listing(state_dir: Path, env: dict[str, str]) -> list[dict[str, Any]]:
    return open_local(state_dir, env).image_report()


def print_listing(rows: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        print(terminal.json_text({"images": rows}, indent=2))
        return
    print(f"{'REFERENCE':<50} {'DIGEST':<19} {'SIZE':>9} {'LAST USED':<25} SANDBOXES")
    for row in rows:
        if row["kind"] != "pulled":
            print(terminal.escape(f"{row['reference']:<50} {'(' + row['kind'] + ')':<19} {'':>9} {'':<25}"))
            continue
        print(
            terminal.escape(
                f"{row['reference']:<50} {row['digest'][:19]:<19} {describe.size(row['size']):>9} "
                f"{row['last_used'] or '-':<25} {row['sandboxes']}"
            )
        )


def prune(state_dir: Path, env: dict[str, str], keep_bytes: int, *, as_json: bool) -> None:
    removed, freed = open_local(state_dir, env).prune_images(keep_bytes)
    if as_json:
        _say({"removed": removed, "freed": freed, "keep": keep_bytes}, "", as_json)
        return
    for image in removed:
        print(terminal.escape(f"removed {image}"))
    print(f"{len(removed)} images removed, {describe.size(freed)} of layers freed")


def add(state_dir: Path, env: dict[str, str], name: str, rootfs: Path, *, as_json: bool) -> None:
    open_local(state_dir, env).images.add_rootfs(name, rootfs)
    report = {"name": name, "kind": "registered", "source": str(rootfs)}
    _say(report, f"registered {name} -> {rootfs}", as_json)


def import_archive(state_dir: Path, env: dict[str, str], name: str, archive: Path, *, as_json: bool) -> None:
    store = open_local(state_dir, env).images
    with bars.counting("unpacking", "layers", shown=bars.wanted(as_json=as_json)) as progress:
        store.import_archive(name, archive, progress=progress)
    report = {"name": name, "kind": "registered", "source": str(archive)}
    _say(report, f"imported {name} from {archive}", as_json)


class _Recorder:
    """Records a CLI pull in the stack's event stream when one is up (else nowhere)."""

    def __init__(self, nc: Any = None, store: Any = None, topology: Any = None) -> None:
        self.nc, self.store, self.topology = nc, store, topology
        self.instance = f"{os.uname().nodename}-{os.getpid()}"

    @classmethod
    async def open(cls, state_dir: Path, env: dict[str, str]) -> _Recorder:
        from sbx import stack
        from shared.contract import subjects
        from shared.infrastructure import bus, eventstore

        try:
            bus_settings = stack.bus_settings(state_dir, env)
            async with asyncio.timeout(3):
                nc = await bus.connect(bus_settings, "sbx-cli", connect_timeout=1)
        except Exception:
            return cls()
        topology = subjects.Topology(bus_settings.namespace)
        store = eventstore.EventStore(
            nc.jetstream(), topology, audit_ttl=bus_settings.retention.audit_max_age
        )
        return cls(nc, store, topology)

    def meta(self) -> events.Meta:
        return events.Meta(
            event_id=ids.new_id(), time=datetime.now(UTC), service="sbx-cli", instance=self.instance
        )

    async def record(self, event: events.ImageEvent) -> None:
        if self.store is None:
            return
        from shared.contract import subjects

        try:
            await self.store.record(self.topology.aggregate_subject(subjects.IMAGE, event.reference), event)
        except errors.SandboxError as exc:
            print(
                terminal.escape(f"sbx: note: the pull was not recorded in the event stream: {exc.message}"),
                file=sys.stderr,
            )

    async def close(self) -> None:
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.close()
