"""Projection checkpoints in a JetStream object store (``<ns>_checkpoints``), written safely.

A checkpoint is one object named for the sequence it covers (``projections-<seq>``). Writing
puts a *new* object: its chunks first, its metadata last, so a checkpoint whose writing was
cut short (a crash, a lost connection) has no metadata, is never listed, and the previous
one stays the latest; only after the new one is complete are older ones (beyond ``KEEP``)
deleted. The latest is the complete object with the highest sequence; its digest is checked
as it is read.

Taking one folds only the events after the previous checkpoint (``replay.fold_stream``), so
its cost follows the events since then, not the history.
"""

from __future__ import annotations

from datetime import UTC, datetime

import nats.js.errors
import structlog
from nats.js import api
from nats.js.client import JetStreamContext
from nats.js.object_store import ObjectStore

from shared.contract import subjects
from shared.domain import checkpoints
from shared.infrastructure import eventstore

log = structlog.get_logger(__name__)

PREFIX = "projections-"
KEEP = 2
"""Complete checkpoints kept: the latest, and the one before it."""


def name_of(seq: int) -> str:
    return f"{PREFIX}{seq:020d}"


def seq_of(name: str) -> int | None:
    rest = name.removeprefix(PREFIX)
    return int(rest) if rest != name and rest.isdigit() else None


async def _store(js: JetStreamContext, topology: subjects.Topology, *, create: bool) -> ObjectStore | None:
    try:
        return await js.object_store(topology.checkpoints_bucket)
    except nats.js.errors.BucketNotFoundError:
        if not create:
            return None
    except nats.js.errors.NotFoundError:
        if not create:
            return None
    return await js.create_object_store(
        topology.checkpoints_bucket,
        api.ObjectStoreConfig(description="projection checkpoints (shared/infrastructure/checkpoints.py)"),
    )


async def _complete(store: ObjectStore) -> list[int]:
    try:
        infos = await store.list(ignore_deletes=True)
    except nats.js.errors.NotFoundError:  # (nats-py: an empty store lists as "not found")
        return []
    return sorted(seq for info in infos if (seq := seq_of(info.name)) is not None)


async def latest(js: JetStreamContext, topology: subjects.Topology) -> checkpoints.Checkpoint | None:
    """The newest complete checkpoint, or None if there is none."""
    try:
        store = await _store(js, topology, create=False)
        if store is None:
            return None
        seqs = await _complete(store)
        if not seqs:
            return None
        result = await store.get(name_of(seqs[-1]))
    except Exception as exc:
        raise eventstore.translate(exc, "reading the latest projection checkpoint") from exc
    assert result.data is not None
    return checkpoints.decode(result.data)


async def write(
    js: JetStreamContext, topology: subjects.Topology, checkpoint: checkpoints.Checkpoint
) -> None:
    """Store ``checkpoint`` as a new object, then drop all but the ``KEEP`` newest."""
    try:
        store = await _store(js, topology, create=True)
        assert store is not None
        await store.put(name_of(checkpoint.seq), checkpoints.encode(checkpoint))
        for seq in (await _complete(store))[:-KEEP]:
            await store.delete(name_of(seq))
    except Exception as exc:
        raise eventstore.translate(exc, f"writing the projection checkpoint at {checkpoint.seq}") from exc
    log.info("checkpoint.written", seq=checkpoint.seq, events=checkpoint.events)


def now() -> datetime:
    return datetime.now(UTC)
