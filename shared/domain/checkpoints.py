"""Projection checkpoints: every projection's fold as of one stream sequence, so a fold can
start there instead of at the first event (pure: the format and the fold rules).

A fold from a checkpoint checks each aggregate's chain: an event's ``prev_seq`` (the
aggregate's last sequence when it was appended) must be the sequence the fold holds for that
aggregate. If it is not, events of that aggregate are gone from the stream (trimmed, or
removed by hand) and neither the checkpoint nor the stream has them: the fold stops with
:class:`HistoryGone` rather than answer a wrong projection.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import msgspec

from sbx_api import errors
from shared.contract import events, states
from shared.domain import projections

FORMAT = 1


class Checkpoint(msgspec.Struct, kw_only=True):
    """Every projection entry as of stream sequence ``seq`` (inclusive)."""

    format: int = FORMAT
    seq: int
    """The last stream sequence folded in: the fold goes on from ``seq + 1``."""
    events: int
    """Events folded into it, over all checkpoints before it."""
    taken_at: datetime
    verified_kv: dict[str, int] = {}
    """Per kind, the KV bucket's stream sequence up to which the live entries were found
    equal to this fold when it was taken (empty: not verified). A later verify then reads
    only the entries written after it, and those the events since ``seq`` touch."""
    session: dict[str, states.SessionState] = {}
    instance: dict[str, states.InstanceState] = {}
    sandbox: dict[str, states.SandboxState] = {}
    proxy: dict[str, states.ProxyState] = {}
    snapshot: dict[str, states.SnapshotState] = {}

    def folded(self) -> dict[str, dict[str, Any]]:
        """Per kind, ``key -> state`` (copies the fold may change)."""
        return {kind: dict(getattr(self, kind)) for kind in projections.BY_KIND}


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Checkpoint)


def encode(checkpoint: Checkpoint) -> bytes:
    return _encoder.encode(checkpoint)


def decode(raw: bytes) -> Checkpoint:
    try:
        checkpoint = _decoder.decode(raw)
    except msgspec.DecodeError as exc:
        raise errors.CorruptEvent(f"a projection checkpoint does not decode: {exc}") from exc
    if checkpoint.format != FORMAT:
        raise errors.CorruptEvent(f"a projection checkpoint has format {checkpoint.format}, not {FORMAT}")
    return checkpoint


def of(
    folded: dict[str, dict[str, Any]],
    *,
    seq: int,
    events: int,
    taken_at: datetime,
    verified_kv: dict[str, int] | None = None,
) -> Checkpoint:
    return Checkpoint(
        seq=seq,
        events=events,
        taken_at=taken_at,
        verified_kv=verified_kv or {},
        session=folded["session"],
        instance=folded["instance"],
        sandbox=folded["sandbox"],
        proxy=folded["proxy"],
        snapshot=folded["snapshot"],
    )


class HistoryGone(errors.CorruptEvent):
    """Events a fold needs are no longer in the stream and no checkpoint covers them."""


def fold_one(
    folded: dict[str, dict[str, Any]], kind: str, key: str, seq: int, prev_seq: int, event: events.Event
) -> None:
    """Fold one stored event into ``folded`` (per kind, ``key -> state``), checking that
    nothing of its aggregate is missing before it."""
    projection = projections.BY_KIND[kind]
    state = folded[kind].get(key)
    have = state.last_seq if state is not None else 0
    if prev_seq >= 0 and prev_seq != have:
        raise HistoryGone(
            f"{kind} {key}: the event at sequence {seq} follows sequence {prev_seq}, but the "
            f"fold holds {have or 'nothing'} for it: that part of its history is gone from the "
            "stream and no checkpoint covers it (take checkpoints before trimming; see "
            "docs/operations.md, 'Checkpoints')"
        )
    folded[kind][key] = projection.evolve(state, event, seq)
