"""A KV bucket followed in memory: one ordered consumer that never ends.

Services that read a whole bucket again and again (the proxy-scaler every round, up to
ten a second, the pool-manager before every provision and every refill round, the reaper every
pass) follow it instead of taking a snapshot each time. A snapshot creates a consumer and
re-reads and re-decodes every key: about 9 ms of CPU across client and server for 80
sandboxes, growing with the bucket (deleted records stay in it). A followed bucket costs
one message per write, decoded once. A mirror may also keep only the entries its owner
ever looks at (``keep``): records of deleted sandboxes and sessions stay in their buckets
for good, and a long-running service should not hold, copy and scan them every round.

``current()`` is as fresh as a snapshot: it asks the stream for its last sequence and
waits until the mirror has seen it, so every write that finished before the call is in
the answer (read-your-writes for the caller and for anyone it heard from). If the mirror
cannot catch up in time (a consumer being recreated after a reconnect), it answers from a
snapshot rather than stale, and keeps doing so without waiting until it has caught up.

``on_change(old, new)`` is called for every kept entry that changes, appears or leaves
(``None`` for absent), once the write is in the bucket: a service can react to a
projection changing without racing the write (an event is published before its
projection is written).

It assumes what projection buckets do: a key's message leaves the bucket only for a newer
write or a delete/purge marker of that key (no TTL, no purge of the whole stream).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Generic, TypeVar

import msgspec
import structlog
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import api
from nats.js.client import JetStreamContext

from sbx_api import errors
from shared.infrastructure import bus

log = structlog.get_logger(__name__)

T = TypeVar("T")

CATCH_UP = 0.5
"""How long ``current()`` waits for the mirror to reach the stream's tail before it takes a
snapshot instead (catching up takes milliseconds; longer means a consumer being
recreated)."""
BEHIND_WAIT = 0.02
"""The same once it has fallen behind: a delivery in flight still makes it (and ends the
fallback); a consumer being recreated does not hold every caller up."""


class Mirror(Generic[T]):
    """Every live key of one bucket, decoded, kept current by a push ordered consumer."""

    def __init__(
        self,
        js: JetStreamContext,
        bucket: str,
        decode: Callable[[bytes], T],
        keep: Callable[[T], bool] | None = None,
        on_change: Callable[[T | None, T | None], None] | None = None,
    ) -> None:
        self.js, self.bucket, self.decode, self.keep = js, bucket, decode, keep
        self.on_change = on_change
        self._behind = False
        self.stream = f"KV_{bucket}"
        self._prefix = f"$KV.{bucket}."
        self._values: dict[str, T] = {}
        self._bad: dict[str, str] = {}
        self._seen = 0
        self._moved = asyncio.Event()
        self._sub: Subscription | None = None
        self.fallbacks = 0
        """Times ``current()`` answered from a snapshot (the mirror was behind)."""

    async def start(self) -> None:
        self._sub = await self.js.subscribe(
            f"{self._prefix}>",
            stream=self.stream,
            ordered_consumer=True,
            deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT,
            cb=self._on_msg,
            pending_msgs_limit=-1,
            pending_bytes_limit=-1,
        )

    async def stop(self) -> None:
        if self._sub is not None:
            sub, self._sub = self._sub, None
            try:
                await sub.unsubscribe()
            except Exception as exc:  # the connection is already closing
                log.debug("kvmirror.unsubscribe_failed", bucket=self.bucket, error=str(exc))

    async def _on_msg(self, msg: Msg) -> None:
        key = msg.subject[len(self._prefix) :]
        self._bad.pop(key, None)
        old = self._values.pop(key, None)
        new = None
        if (msg.headers or {}).get("KV-Operation") not in ("DEL", "PURGE"):
            try:
                value = self.decode(msg.data)
            except msgspec.DecodeError as exc:
                self._bad[key] = str(exc)
            else:
                if self.keep is None or self.keep(value):
                    self._values[key] = new = value
        self._seen = max(self._seen, msg.metadata.sequence.stream)
        self._moved.set()
        if self.on_change is not None and (old is not None or new is not None):
            try:
                self.on_change(old, new)
            except Exception:
                log.exception("kvmirror.on_change_failed", bucket=self.bucket)

    def heard(self, key: str) -> T | None:
        """The (kept) value of ``key`` as last heard, without waiting for the bucket."""
        return self._values.get(key)

    async def current(self) -> dict[str, T]:
        """Every (kept) key as of the end of the call (a copy: callers may keep it)."""
        fallback = await self.sync()
        return fallback if fallback is not None else dict(self._values)

    async def sync(self) -> dict[str, T] | None:
        """Wait until every write that finished before the call is in the mirror (and has
        been told to ``on_change``): None then. If the mirror cannot catch up in time, the
        (kept) keys of a snapshot instead."""
        if self._sub is None:
            raise RuntimeError(f"the mirror of {self.bucket} is not started")
        state = (await self.js.stream_info(self.stream)).state
        if not state.messages:  # purged or empty: nothing to wait for (as a snapshot says)
            return None if not self._values else {}
        tail = state.last_seq
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (BEHIND_WAIT if self._behind else CATCH_UP)
        while self._seen < tail:
            self._moved.clear()
            try:
                async with asyncio.timeout(max(0.0, deadline - loop.time())):
                    await self._moved.wait()
            except TimeoutError:
                self._behind = True  # until it catches up, answer from snapshots at once
                return self._from_snapshot(await bus.snapshot(self.js, self.bucket), tail)
        self._behind = False
        if self._bad:
            key, problem = next(iter(self._bad.items()))
            raise errors.CorruptEvent(f"{self.bucket} entry {key} does not decode: {problem}")
        return None

    def _from_snapshot(self, raw: dict[str, bytes], tail: int) -> dict[str, T]:
        self.fallbacks += 1
        log.warning("kvmirror.behind", bucket=self.bucket, seen=self._seen, tail=tail)
        return decode_all(raw, self.decode, self.bucket, self.keep)


def decode_all(
    raw: dict[str, bytes],
    decode: Callable[[bytes], T],
    bucket: str,
    keep: Callable[[T], bool] | None = None,
) -> dict[str, T]:
    """A snapshot's values decoded (those ``keep`` accepts); one that does not decode is
    an error, never skipped."""
    out: dict[str, T] = {}
    for key, value in raw.items():
        try:
            decoded = decode(value)
        except msgspec.DecodeError as exc:
            raise errors.CorruptEvent(f"{bucket} entry {key} does not decode: {exc}") from exc
        if keep is None or keep(decoded):
            out[key] = decoded
    return out
