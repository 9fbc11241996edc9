"""Rebuilding projections from the stream, and proving the live KV equals them.

Invariant 2 (KV is a projection) is checked by :func:`verify`: fold the events
into fresh states and compare them key by key with the live buckets. The fold
starts from the latest checkpoint (:mod:`shared.infrastructure.checkpoints`),
so it costs the events since then, not the history (``full=True``: from the
first event). Each aggregate's chain is checked as it is folded, so a stream
whose older events were trimmed without a checkpoint covering them fails
loudly (``checkpoints.HistoryGone``) instead of giving a wrong projection.
Entries that moved on while the fold ran (their ``last_seq`` is past the fold's
end) are folded again from their own subject before being judged, so a live
system can be verified without stopping it.
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
from shared.domain import checkpoints, projections
from shared.infrastructure import bus, eventstore, projector
from shared.infrastructure import checkpoints as stored_checkpoints

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
    from_seq: int = 0
    """The checkpoint the fold started from (0: the first event)."""
    events: int = 0
    compared: int = 0
    """Live entries read and compared."""
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
    store: eventstore.EventStore,
    *,
    up_to: int,
    start: checkpoints.Checkpoint | None = None,
    progress: Progress | None = None,
) -> tuple[dict[str, dict[str, Any]], int]:
    """Fold the events with sequence <= ``up_to`` into fresh states per kind, on top of
    ``start`` (from the event after it; None: from the first event); also how many events
    were read. ``checkpoints.HistoryGone`` if an aggregate's earlier events are missing."""
    folded: dict[str, dict[str, Any]] = (
        start.folded() if start is not None else {kind: {} for kind in projections.BY_KIND}
    )
    count = 0
    first = start.seq + 1 if start is not None else 1
    if up_to < first:
        return folded, 0
    async with contextlib.aclosing(store.read(start_seq=first)) as stream:
        async for stored in stream:
            if stored.seq > up_to:
                break
            kind = store.topology.kind_of(stored.subject)
            if kind in projections.BY_KIND:
                key = projections.BY_KIND[kind].key_of_subject(stored.subject)
                checkpoints.fold_one(folded, kind, key, stored.seq, stored.prev_seq, stored.event)
            count += 1
            if progress is not None and (count % PROGRESS_EVERY == 0 or stored.seq >= up_to):
                progress(stored.seq, up_to)
            if stored.seq >= up_to:
                break
    return folded, count


async def _base(
    js: JetStreamContext, topology: subjects.Topology, full: bool
) -> checkpoints.Checkpoint | None:
    return None if full else await stored_checkpoints.latest(js, topology)


async def take_checkpoint(
    js: JetStreamContext, topology: subjects.Topology, *, progress: Progress | None = None
) -> Report:
    """Fold the events since the latest checkpoint onto it, compare the result with every
    live entry, and store it as the new latest (nothing is written if no event came
    since). If the live entries all match, the checkpoint records how far each bucket was
    read (``verified_kv``), so later verifies read only what changed after it."""
    store = eventstore.EventStore(js, topology)
    started = time.perf_counter()
    base = await stored_checkpoints.latest(js, topology)
    up_to = await store.last_seq()
    folded, count = await fold_stream(store, up_to=up_to, start=base, progress=progress)
    report = Report(from_seq=base.seq if base is not None else 0, events=count)
    if base is None or up_to > base.seq:
        kv_seqs: dict[str, int] = {}
        for kind, target in (await _stores(js, store)).items():
            kv_seqs[kind] = (await js.stream_info(f"KV_{target.kv_bucket}")).state.last_seq
            live = await target.all()
            report.aggregates[kind] = len(folded[kind])
            report.compared += len(live)
            report.differences += await _judged(store, target, up_to, diff(kind, folded[kind], live))
        total = (base.events if base is not None else 0) + count
        checkpoint = checkpoints.of(
            folded,
            seq=up_to,
            events=total,
            taken_at=stored_checkpoints.now(),
            verified_kv=kv_seqs if not report.differences else None,
        )
        await stored_checkpoints.write(js, topology, checkpoint)
    report.seconds = time.perf_counter() - started
    return report


async def _judged(
    store: eventstore.EventStore,
    target: projector.ProjectionStore[Any],
    up_to: int,
    differences: list[Difference],
) -> list[Difference]:
    """The differences that stand: an entry written after the fold's end is judged
    against its full history instead."""
    out = []
    for difference in differences:
        moved_on = difference.actual is not None and difference.actual.get("last_seq", 0) > up_to
        if moved_on:
            subject = store.topology.subject_of_key(difference.kind, difference.key)
            history = await store.load(subject)
            fresh = target.projection.fold((s.seq, s.event) for s in history)
            if fresh is not None and codec.to_builtins(fresh) == difference.actual:
                continue
        out.append(difference)
    return out


async def _live_since(
    target: projector.ProjectionStore[Any], kv_seq: int, touched: set[str]
) -> dict[str, Any]:
    """The live entries written after ``kv_seq``, and those of ``touched``: the only ones
    that can differ from a verified checkpoint's fold."""
    changed, _ = await bus.changed_since(target.store_js, target.kv_bucket, kv_seq)
    live: dict[str, Any] = {}
    for key, raw in changed.items():
        if raw is not None:
            live[key] = target.decode(raw)
    for key in touched - changed.keys():
        state, _ = await target.get_entry(key)
        if state is not None:
            live[key] = state
    return live


async def _stores(
    js: JetStreamContext, store: eventstore.EventStore
) -> dict[str, projector.ProjectionStore[Any]]:
    return {
        kind: await projector.ProjectionStore.open(js, p, store) for kind, p in projections.BY_KIND.items()
    }


async def verify(
    js: JetStreamContext,
    topology: subjects.Topology,
    *,
    progress: Progress | None = None,
    full: bool = False,
) -> Report:
    """Compare the fold with the live entries. From a verified checkpoint, only the entries
    the events since it touch and those written in KV since it are compared (both O(what
    changed)); otherwise every live entry is read."""
    store = eventstore.EventStore(js, topology)
    started = time.perf_counter()
    base = await _base(js, topology, full)
    up_to = await store.last_seq()
    folded, count = await fold_stream(store, up_to=up_to, start=base, progress=progress)
    report = Report(from_seq=base.seq if base is not None else 0, events=count)
    for kind, target in (await _stores(js, store)).items():
        report.aggregates[kind] = len(folded[kind])
        if base is not None and kind in base.verified_kv:
            before = getattr(base, kind)
            touched = {k for k, v in folded[kind].items() if before.get(k) is not v}
            live = await _live_since(target, base.verified_kv[kind], touched)
            wanted = {k: folded[kind][k] for k in live.keys() | touched if k in folded[kind]}
        else:
            live, wanted = await target.all(), folded[kind]
        report.compared += len(live)
        report.differences += await _judged(store, target, up_to, diff(kind, wanted, live))
    report.seconds = time.perf_counter() - started
    return report


async def rebuild(
    js: JetStreamContext,
    topology: subjects.Topology,
    *,
    progress: Progress | None = None,
    full: bool = False,
) -> Report:
    """Rewrite every projection entry that differs from the fold of the stream (from the
    latest checkpoint unless ``full``).

    Safe on a live stack: each write is a revision CAS, and an entry that moved
    past the fold (a writer got there first) is left alone. An entry the fold does not
    know whose events may have been trimmed (its ``last_seq`` is below the stream's first
    sequence) is never removed: ``checkpoints.HistoryGone``, before anything is written.
    """
    store = eventstore.EventStore(js, topology)
    started = time.perf_counter()
    base = await _base(js, topology, full)
    folded, count = await fold_stream(store, up_to=await store.last_seq(), start=base, progress=progress)
    first_seq = (await js.stream_info(topology.events_stream)).state.first_seq
    report = Report(from_seq=base.seq if base is not None else 0, events=count)
    plans = []
    for kind, target in (await _stores(js, store)).items():
        live = await target.all()
        report.aggregates[kind] = len(folded[kind])
        todo = diff(kind, folded[kind], live)
        for d in todo:
            if d.expected is None and d.actual is not None and d.actual.get("last_seq", 0) < first_seq:
                raise checkpoints.HistoryGone(
                    f"{kind} {d.key} is in KV (last_seq {d.actual.get('last_seq')}) but its events "
                    f"are gone from the stream (it starts at {first_seq}) and no checkpoint covers "
                    "them: nothing was rewritten"
                )
        plans.append((kind, target, todo))
    for kind, target, todo in plans:
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
