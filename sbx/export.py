"""``sbx events export``: audit records (or any events) as JSON lines, resumable, so an
operator's cron job archives them before retention removes them (docs/operations.md).

Where to go on is the larger of ``--since-seq``, the cursor file's sequence + 1 and the
last line of the output file + 1. The output file itself is the safest cursor: a line
is only ever complete or cut (a cut last line, from a crash, is removed before
appending), so a resumed export neither repeats nor skips a record. The cursor file is
written (atomically) after every flushed batch, for output that goes to a pipe.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import IO, Any

from nats.aio.client import Client

from sbx_api import errors
from sbx_client import terminal
from shared.contract import subjects
from shared.infrastructure import eventstore
from shared.infrastructure.settings import bus

BATCH = 1000
"""Records written between two flushes (and cursor updates)."""
TAIL = 1 << 20
"""How far back from its end the output file is read for its last line (a record's line
is at most a few tens of KiB)."""
KINDS = (*subjects.AUDIT_KINDS, *subjects.PROJECTED_KINDS)


def kinds_of(names: list[str], every: bool) -> tuple[str, ...]:
    """The kinds to export: the audit kinds by default, every kind with ``--all``."""
    if every:
        return KINDS
    for name in names:
        if name not in KINDS:
            raise errors.InvalidInput(f"--kind {name!r} is not a kind of event: one of {', '.join(KINDS)}")
    return tuple(names) or subjects.AUDIT_KINDS


def read_cursor(path: Path | None) -> tuple[int, datetime | None]:
    """The last exported sequence a cursor file holds (0 when there is none) and the time of
    that record."""
    if path is None or not path.exists():
        return 0, None
    try:
        data = json.loads(path.read_text())
        seq = int(data["seq"])
        at = datetime.fromisoformat(data["time"]) if data.get("time") else None
    except (ValueError, KeyError, TypeError) as exc:
        raise errors.InvalidInput(f"{path} is not a cursor of sbx events export: {exc}") from None
    if seq < 0:
        raise errors.InvalidInput(f"{path}: the sequence {seq} is negative")
    return seq, at


def write_cursor(path: Path, seq: int, at: datetime | None) -> None:
    """Replace the cursor file in one step (a reader never sees half of it)."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps({"seq": seq, "time": at.isoformat() if at else None}) + "\n")
    with open(partial, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(partial, path)


def last_exported(path: Path | None) -> int:
    """The sequence on the output file's last complete line (0: none); a cut last line is
    removed first."""
    if path is None or not path.exists():
        return 0
    with open(path, "rb+") as handle:
        end = handle.seek(0, os.SEEK_END)
        start = max(0, end - TAIL)
        handle.seek(start)
        tail = handle.read()
        if tail and not tail.endswith(b"\n"):
            cut = tail.rfind(b"\n")
            if cut < 0 and start > 0:
                raise errors.InvalidInput(f"{path}: its last line is longer than {TAIL} bytes")
            handle.truncate(start + cut + 1)
            tail = tail[: cut + 1]
    lines = tail.splitlines()
    if not lines:
        return 0
    try:
        return int(json.loads(lines[-1])["seq"])
    except (ValueError, KeyError, TypeError) as exc:
        raise errors.InvalidInput(f"{path}: its last line is not an exported record ({exc})") from None


def record(stored: eventstore.Stored) -> dict[str, Any]:
    """One exported line: what ``sbx events --json`` prints."""
    from shared.contract import codec

    return {"seq": stored.seq, "subject": stored.subject, "event": codec.to_builtins(stored.event)}


async def export(
    nc: Client,
    topology: subjects.Topology,
    *,
    kinds: tuple[str, ...],
    since: int,
    cursor: Path | None,
    output: Path | None,
    retention: bus.RetentionSettings,
) -> int:
    """Write the records of ``kinds`` from where the last export stopped to the stream's
    current end; a summary line on stderr."""
    after, last_time = read_cursor(cursor)
    start = max(since, after + 1, last_exported(output) + 1)
    _warn_if_expired(after, last_time, retention)
    store = eventstore.EventStore(nc.jetstream(), topology)
    filters = [topology.events_of_kind(kind) for kind in kinds]
    count, first, last = 0, 0, start - 1
    with _opened(output) as out:
        async with contextlib.aclosing(store.read(filters, start_seq=start)) as stream:
            async for stored in stream:
                out.write(terminal.json_line(record(stored)) + "\n")
                count, first, last = count + 1, first or stored.seq, stored.seq
                last_time = stored.event.meta.time
                if count % BATCH == 0:
                    _flush(out, cursor, last, last_time)
        _flush(out, cursor, last, last_time)
    span = f" (seq {first}..{last})" if count else ""
    print(f"sbx: exported {count} records{span}; the next export starts at seq {last + 1}", file=sys.stderr)
    return 0


@contextlib.contextmanager
def _opened(output: Path | None) -> Any:
    if output is None:
        yield sys.stdout
        return
    with open(output, "a", encoding="utf-8") as handle:
        yield handle


def _flush(out: IO[str], cursor: Path | None, last: int, at: datetime | None) -> None:
    out.flush()
    if out is not sys.stdout:
        os.fsync(out.fileno())
    if cursor is not None and last > 0:
        write_cursor(cursor, last, at)


def _warn_if_expired(after: int, last_time: datetime | None, retention: bus.RetentionSettings) -> None:
    """Records older than the audit TTL are gone: if the last export is older than that,
    some written after it may have expired unexported."""
    if not after or last_time is None or not retention.audit_max_age:
        return
    if datetime.now(UTC) - last_time > timedelta(seconds=retention.audit_max_age):
        print(
            f"sbx: warning: the last export ended at a record of {last_time.isoformat()}, longer ago "
            "than SBX_AUDIT_MAX_AGE: records written after it may have expired unexported",
            file=sys.stderr,
        )
