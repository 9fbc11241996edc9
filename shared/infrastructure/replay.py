"""Rebuilding projections from the stream, and proving the live KV equals them.

Invariant 2 (KV is a projection) is checked by :func:`verify`: fold every event
into fresh states and compare them key by key with the live buckets. Entries
that moved on while the fold ran (their ``last_seq`` is past the fold's end) are
folded again from their own subject before being judged, so a live system can
be verified without stopping it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import nats.js.errors
from nats.js.client import JetStreamContext

from sbx_api import errors
from shared.contract import codec, subjects
from shared.domain import projections
from shared.infrastructure import eventstore, projector

#: KV writes in flight at once during a rebuild.
REWRITE_CONCURRENCY = 256
#: Events folded between two calls of a fold's ``progress`` callback.
PROGRESS_EVERY = 500

Progress = Callable[[int, int], None]
"""Told ``(sequence folded, last sequence)`` as a fold goes (a progress bar)."""


@dataclass(frozen=True)
class Difference:
    kind: str
    key: str
    expected: dict[str, Any] | None
    """What the stream says (``None``: no such aggregate in the stream)."""
    actual: dict[str, Any] | None
    """What the live KV holds (``None``: missing)."""

    def describe(self) -> str:
        if self.actual is None:
            seq = self.expected.get("last_seq") if self.expected else None
            return f"{self.kind} {self.key}: missing from KV (stream has last_seq {seq})"
        if self.expected is None:
            return f"{self.kind} {self.key}: in KV but not in the stream"
        fields = sorted(
            k for k in {*self.expected, *self.actual} if self.expected.get(k) != self.actual.get(k)
        )
        changes = ", ".join(f"{k}: stream={self.expected.get(k)!r} kv={self.actual.get(k)!r}" for k in fields)
        return f"{self.kind} {self.key}: {changes}"


@dataclass
class Report:
    events: int = 0
    seconds: float = 0.0
    aggregates: dict[str, int] = field(default_factory=dict)
    differences: list[Difference] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.events / self.seconds if self.seconds > 0 else float("inf")


def diff(kind: str, expected: dict[str, Any], actual: dict[str, Any]) -> list[Difference]:
    """Pure comparison of two ``key -> state`` maps."""
    out: list[Difference] = []
    for key in sorted({*expected, *actual}):
        want, have = expected.get(key), actual.get(key)
        if want != have:
            out.append(
                Difference(
                    kind,
                    key,
                    codec.to_builtins(want) if want is not None else None,
                    codec.to_builtins(have) if have is not None else None,
                )
            )
    return out


async def fold_stream(
    store: eventstore.EventStore, *, up_to: int, progress: Progress | None = None
) -> tuple[dict[str, dict[str, Any]], int]:
    """Fold every event with sequence <= ``up_to`` into fresh states, per kind."""
    folded: dict[str, dict[str, Any]] = {kind: {} for kind in projections.BY_KIND}
    count = 0
    if up_to == 0:
        return folded, 0
    async with contextlib.aclosing(store.read()) as stream:
        async for stored in stream:
            kind = store.topology.kind_of(stored.subject)
            projection = projections.BY_KIND.get(kind)
            if projection is not None:
                key = projection.key_of_subject(stored.subject)
                folded[kind][key] = projection.evolve(folded[kind].get(key), stored.event, stored.seq)
            count += 1
            if progress is not None and (count % PROGRESS_EVERY == 0 or stored.seq >= up_to):
                progress(stored.seq, up_to)
            if stored.seq >= up_to:
                break
    return folded, count


async def _stores(
    js: JetStreamContext, store: eventstore.EventStore
) -> dict[str, projector.ProjectionStore[Any]]:
    return {
        kind: await projector.ProjectionStore.open(js, p, store) for kind, p in projections.BY_KIND.items()
    }


async def verify(
    js: JetStreamContext, topology: subjects.Topology, *, progress: Progress | None = None
) -> Report:
    store = eventstore.EventStore(js, topology)
    started = time.perf_counter()
    up_to = await store.last_seq()
    folded, count = await fold_stream(store, up_to=up_to, progress=progress)
    report = Report(events=count)
    for kind, target in (await _stores(js, store)).items():
        live = await target.all()
        report.aggregates[kind] = len(folded[kind])
        for difference in diff(kind, folded[kind], live):
            moved_on = difference.actual is not None and difference.actual.get("last_seq", 0) > up_to
            if moved_on:  # written after our fold started: judge it against its full history
                history = await store.load(topology.subject_of_key(kind, difference.key))
                fresh = target.projection.fold((s.seq, s.event) for s in history)
                if fresh is not None and codec.to_builtins(fresh) == difference.actual:
                    continue
            report.differences.append(difference)
    report.seconds = time.perf_counter() - started
    return report


async def rebuild(
    js: JetStreamContext, topology: subjects.Topology, *, progress: Progress | None = None
) -> Report:
    """Rewrite every projection entry that differs from the fold of the stream.

    Safe on a live stack: each write is a revision CAS, and an entry that moved
    past the fold (a writer got there first) is left alone.
    """
    store = eventstore.EventStore(js, topology)
    started = time.perf_counter()
    folded, count = await fold_stream(store, up_to=await store.last_seq(), progress=progress)
    report = Report(events=count)
    for kind, target in (await _stores(js, store)).items():
        live = await target.all()
        report.aggregates[kind] = len(folded[kind])
        todo = diff(kind, folded[kind], live)
        for start in range(0, len(todo), REWRITE_CONCURRENCY):  # keys are independent: pipeline
            chunk = todo[start : start + REWRITE_CONCURRENCY]
            written = await asyncio.gather(*(_rewrite(target, d.key, folded[kind].get(d.key)) for d in chunk))
            report.differences.extend(d for d, done in zip(chunk, written, strict=True) if done)
    report.seconds = time.perf_counter() - started
    return report


async def _rewrite(target: projector.ProjectionStore[Any], key: str, want: Any) -> bool:
    for _ in range(10):
        have, revision = await target.get_entry(key)
        if have is not None and want is not None and have.last_seq > want.last_seq:
            return False  # a writer moved it on while we folded: newer than our fold
        try:
            if want is None:
                await target.kv.purge(key)
            elif revision is None:
                await target.kv.create(key, codec.encode(want))
            else:
                await target.kv.update(key, codec.encode(want), last=revision)
        except nats.js.errors.KeyWrongLastSequenceError:
            continue
        return True
    raise errors.ConcurrencyError(f"{target.kv_bucket} {key} kept changing during the rebuild")
