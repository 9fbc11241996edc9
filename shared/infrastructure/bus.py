"""Connecting to NATS and creating the stream and buckets, idempotently.

Whichever process starts first creates the topology; the rest find it. A
definition that changed between versions is updated in place for the event
stream; buckets keep their existing definition (with a warning).
"""

from __future__ import annotations

import dataclasses

import nats
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client
from nats.js import api
from nats.js.client import JetStreamContext

from sbx_api import errors
from shared.contract import subjects
from shared.infrastructure import eventstore, jetstream
from shared.infrastructure.settings import bus as bus_settings

log = structlog.get_logger(__name__)

STREAM_NAME_IN_USE = 10058


async def connect(bus: bus_settings.BusSettings, name: str, *, connect_timeout: float = 5.0) -> Client:
    """Connect with unlimited reconnects; raise Unavailable if the first connect fails."""

    async def on_error(exc: Exception) -> None:
        log.warning("nats.error", error=str(exc))

    async def on_disconnected() -> None:
        log.info("nats.disconnected")

    async def on_reconnected() -> None:
        log.info("nats.reconnected")

    try:
        return await nats.connect(
            servers=bus.servers,
            name=name,
            token=bus.nats_token,
            connect_timeout=connect_timeout,
            allow_reconnect=True,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            error_cb=on_error,
            disconnected_cb=on_disconnected,
            reconnected_cb=on_reconnected,
        )
    except Exception as exc:
        raise errors.Unavailable(f"cannot connect to NATS at {bus.nats_url}: {exc}") from exc


async def ensure_topology(js: JetStreamContext, topology: subjects.Topology, *, replicas: int = 1) -> None:
    """Create the event stream, the pool stream and the buckets if missing, with
    ``replicas`` copies each. What exists keeps its number of copies: a service starting
    with another setting never lowers (or raises) it; ``set_replicas`` does, on purpose.
    An existing event stream gets the current definition (per-message TTLs allowed)."""
    await _ensure_events_stream(js, topology, replicas)
    try:
        await js.add_stream(jetstream.pool_stream(topology, replicas))
    except nats.js.errors.BadRequestError as exc:
        if getattr(exc, "err_code", None) != STREAM_NAME_IN_USE:
            raise eventstore.translate(exc, "creating the pool stream") from exc
    except Exception as exc:
        raise eventstore.translate(exc, "creating the pool stream") from exc
    for config in jetstream.buckets(topology, replicas):
        await _ensure_bucket(js, config)
    for kind in subjects.PROJECTED_KINDS:
        await _move_legacy_bucket(js, topology, kind)


async def _ensure_events_stream(js: JetStreamContext, topology: subjects.Topology, replicas: int) -> None:
    """Create the event stream, or bring an existing one's definition up to date (its
    number of copies kept): a stack made before audit records expired gets the per-message
    TTLs they need on its next start."""
    stream = jetstream.events_stream(topology, replicas)
    try:
        made = await js.add_stream(stream)
    except nats.js.errors.BadRequestError as exc:
        if getattr(exc, "err_code", None) != STREAM_NAME_IN_USE:
            raise eventstore.translate(exc, "creating the event stream") from exc
    except Exception as exc:
        raise eventstore.translate(exc, "creating the event stream") from exc
    else:
        _check_limits(made.config)
        return
    try:
        current = await js.stream_info(topology.events_stream)
        kept = dataclasses.replace(stream, num_replicas=current.config.num_replicas)
        updated = await js.update_stream(kept)
    except Exception as exc:
        raise eventstore.translate(exc, "updating the event stream") from exc
    _check_limits(updated.config)
    log.info("bus.stream_updated", stream=topology.events_stream)


def _check_limits(config: api.StreamConfig) -> None:
    """A server older than NATS 2.11 accepts the definition but ignores per-message TTLs:
    audit records would then never expire. Refuse to run on it rather than grow for ever."""
    if not config.allow_msg_ttl:
        raise errors.ConfigError(
            f"the NATS server keeps no per-message TTL on stream {config.name} (NATS 2.11 or "
            "newer is needed: audit records expire by their own TTL); upgrade the server"
        )


async def _ensure_bucket(js: JetStreamContext, config: api.KeyValueConfig) -> None:
    """Create a bucket; one that exists keeps its definition (with a warning if it differs)."""
    try:
        await js.create_key_value(config)
    except nats.js.errors.BadRequestError as exc:
        if getattr(exc, "err_code", None) != STREAM_NAME_IN_USE:
            raise eventstore.translate(exc, f"creating bucket {config.bucket}") from exc
        log.warning("bus.bucket_definition_differs", bucket=config.bucket)
    except Exception as exc:
        raise eventstore.translate(exc, f"creating bucket {config.bucket}") from exc


def stream_names(topology: subjects.Topology) -> list[str]:
    """Every JetStream stream of a topology: the two streams and each bucket's."""
    kv = [f"KV_{config.bucket}" for config in jetstream.buckets(topology)]
    return [topology.events_stream, topology.pool_stream, *kv]


async def set_replicas(js: JetStreamContext, topology: subjects.Topology, replicas: int) -> dict[str, int]:
    """Change the number of copies of every stream and bucket (the server moves the data);
    returns each stream's count before."""
    before: dict[str, int] = {}
    for name in stream_names(topology):
        try:
            info = await js.stream_info(name)
            before[name] = info.config.num_replicas or 1
            if before[name] != replicas:
                await js.update_stream(dataclasses.replace(info.config, num_replicas=replicas))
        except Exception as exc:
            raise eventstore.translate(exc, f"changing the copies of {name}") from exc
    return before


async def _move_legacy_bucket(js: JetStreamContext, topology: subjects.Topology, kind: str) -> None:
    """A state dir from before the buckets' names were spelled right (``sbx_sandboxs``):
    copy each key the new bucket lacks, then delete the old bucket. Safe to run from
    every process at once: a key is only created, never overwritten, and a reader that
    meets the new bucket before the copy ends rebuilds from the stream as it would after
    any concurrent write."""
    old, new = topology.legacy_bucket(kind), topology.bucket(kind)
    if old == new:
        return
    try:
        entries = await snapshot(js, old)
    except nats.js.errors.NotFoundError:
        return
    kv = await js.key_value(new)
    for key, value in entries.items():
        try:
            await kv.create(key, value)
        except nats.js.errors.KeyWrongLastSequenceError:
            pass  # already written under the new name: that copy is newer
    try:
        await js.delete_key_value(old)
    except nats.js.errors.NotFoundError:
        pass  # another process finished first
    log.warning("bus.bucket_renamed", old=old, new=new, keys=len(entries))


SNAPSHOT_QUIET = 2.0
"""How long a snapshot waits for the next key before deciding the tail is gone."""
SNAPSHOT_ROUNDS = 20
"""At most this many catch-ups with a bucket written while it is read."""


async def snapshot(js: JetStreamContext, bucket: str) -> dict[str, bytes]:
    """Every live key of a KV bucket and its value, as of the end of the call.

    Takes the last message of every key with an ordered consumer, reading until it has
    seen the bucket's last stream sequence, then checks that sequence again and reads
    on if keys were written meanwhile. Messages come in stream order, so once the tail
    is reached every key is there: a key updated during the pass is delivered at its
    new place, later. (The consumer's ``num_pending`` is not enough: it can reach 0
    while such a key is still to come, which let two pool-managers count 2 running
    sandboxes where there were 3; and nats-py's ``watchall`` can signal "initial
    values done" before delivering them.)
    """
    stream = f"KV_{bucket}"
    state = (await js.stream_info(stream)).state
    if not state.messages:
        return {}
    tail = state.last_seq
    prefix = f"$KV.{bucket}."
    sub = await js.subscribe(
        f"{prefix}>",
        stream=stream,
        ordered_consumer=True,
        deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT,
        pending_msgs_limit=-1,
        pending_bytes_limit=-1,
    )
    out: dict[str, bytes] = {}
    seen = 0
    try:
        for _ in range(SNAPSHOT_ROUNDS):
            while seen < tail:
                try:
                    msg = await sub.next_msg(timeout=SNAPSHOT_QUIET)
                except nats.errors.TimeoutError:
                    break  # the tail expired or was purged (a TTL bucket): nothing more comes
                key = msg.subject[len(prefix) :]
                if (msg.headers or {}).get("KV-Operation") in ("DEL", "PURGE"):
                    out.pop(key, None)
                else:
                    out[key] = msg.data
                seen = msg.metadata.sequence.stream
            newer = (await js.stream_info(stream)).state.last_seq
            if newer <= tail or seen < tail:
                return out
            tail = newer
        return out
    finally:
        await sub.unsubscribe()


async def changed_since(js: JetStreamContext, bucket: str, after: int) -> tuple[dict[str, bytes | None], int]:
    """The keys of a KV bucket written after its stream sequence ``after``, each with its
    latest value (None: deleted or purged), and the stream sequence read up to: reads only
    those writes, so it costs what changed, not the bucket."""
    stream = f"KV_{bucket}"
    tail = (await js.stream_info(stream)).state.last_seq
    out: dict[str, bytes | None] = {}
    if tail <= after:
        return out, tail
    prefix = f"$KV.{bucket}."
    sub = await js.subscribe(
        f"{prefix}>",
        stream=stream,
        ordered_consumer=True,
        config=api.ConsumerConfig(
            deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=after + 1
        ),
        pending_msgs_limit=-1,
        pending_bytes_limit=-1,
    )
    try:
        seen = after
        while seen < tail:
            try:
                msg = await sub.next_msg(timeout=SNAPSHOT_QUIET)
            except nats.errors.TimeoutError:
                break  # the rest was overwritten by later writes of the same keys (compacted)
            key = msg.subject[len(prefix) :]
            deleted = (msg.headers or {}).get("KV-Operation") in ("DEL", "PURGE")
            out[key] = None if deleted else msg.data
            seen = msg.metadata.sequence.stream
    finally:
        await sub.unsubscribe()
    return out, tail
