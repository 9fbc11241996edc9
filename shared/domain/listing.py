"""Ordered indexes for list pages: every filter combination a list endpoint offers is one
sorted list of positions, so a page is a bisect and a slice, and its total a ``len``.

A list request names one index (its filters, e.g. status + org) and a position to start
after (keyset paging: the order key of the last item it was shown). An item sits in one
list per filter combination it matches, wildcards included (``memberships``), so adding,
changing or removing an item costs a bisect per membership (16 for a session) and a page
costs O(log n + page) whatever the history holds.

Positions are ``(time in microseconds, id)``: unique and stable for an item's life, so a
page boundary never skips or repeats an item that existed through the paging, however many
are created or removed meanwhile (new items come after the boundary; removed ones just
stop appearing).

Pure: no I/O; the gateway keeps one per bucket it lists, fed by the bucket's changes.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Generic, TypeVar

from shared.contract import states

T = TypeVar("T")

Position = tuple[int, str]
"""Where an item sits in every list it belongs to: (creation time in µs, its id)."""

Selector = tuple[Hashable, ...]
"""Which list: one value (or ``None``: any) per filter dimension."""


def micros(moment: datetime) -> int:
    return int(moment.timestamp() * 1_000_000)


@dataclass(frozen=True)
class Page(Generic[T]):
    items: list[T]
    total: int
    """How many items the selector matches (all pages)."""
    last: Position | None
    """The position to continue after (None: this was the last page)."""


class Index(Generic[T]):
    """Items kept in one sorted list per selector they match."""

    def __init__(
        self,
        memberships: Callable[[T], Iterable[Selector]],
        position: Callable[[T], Position],
    ) -> None:
        self._memberships, self._position = memberships, position
        self._lists: dict[Selector, list[Position]] = {}
        self._items: dict[str, T] = {}

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: T) -> None:
        """Add ``item``, or replace the one with its id."""
        position = self._position(item)
        self.remove(position[1])
        self._items[position[1]] = item
        for selector in set(self._memberships(item)):
            bisect.insort(self._lists.setdefault(selector, []), position)

    def discard(self, item: T) -> None:
        self.remove(self._position(item)[1])

    def remove(self, item_id: str) -> None:
        old = self._items.pop(item_id, None)
        if old is None:
            return
        position = self._position(old)
        for selector in set(self._memberships(old)):
            entries = self._lists[selector]
            at = bisect.bisect_left(entries, position)
            if at < len(entries) and entries[at] == position:
                del entries[at]
            if not entries:
                del self._lists[selector]

    def page(self, selector: Selector, *, after: Position | None, limit: int) -> Page[T]:
        entries = self._lists.get(selector, [])
        start = bisect.bisect_right(entries, after) if after is not None else 0
        chosen = entries[start : start + limit]
        more = start + limit < len(entries)
        return Page(
            items=[self._items[item_id] for _, item_id in chosen],
            total=len(entries),
            last=chosen[-1] if more and chosen else None,
        )


def _any_or(value: Hashable) -> tuple[Hashable, ...]:
    """The values of one dimension an item matches: any (None), and its own if it has one."""
    return (None,) if value is None else (None, value)


# ---- sessions ---------------------------------------------------------------------------------

SESSION_STATUSES = states.SESSION_STATUSES
"""What ``status`` may select; no status selects every session not deleted ("live")."""
LIVE = "live"


def session_selector(
    status: str | None, org_id: str | None, user_id: str | None, image: str | None
) -> Selector:
    return (status or LIVE, org_id, user_id, image)


def session_memberships(s: states.SessionState) -> Iterable[Selector]:
    wanted = (s.status,) if s.status == "deleted" else (LIVE, s.status)
    for status in wanted:
        for org in _any_or(s.org_id):
            for user in _any_or(s.user_id):
                for image in _any_or(s.image):
                    yield (status, org, user, image)


def session_position(s: states.SessionState) -> Position:
    return (micros(s.created_at), s.session_id)


def session_index() -> Index[states.SessionState]:
    return Index(session_memberships, session_position)


# ---- snapshots --------------------------------------------------------------------------------

SNAPSHOT_STATUSES = states.SNAPSHOT_STATUSES


def snapshot_selector(status: str | None, org_id: str | None, session_id: str | None) -> Selector:
    return (status or LIVE, org_id, session_id)


def snapshot_memberships(s: states.SnapshotState) -> Iterable[Selector]:
    wanted = (s.status,) if s.status == "deleted" else (LIVE, s.status)
    for status in wanted:
        for org in _any_or(s.org_id):
            for session in _any_or(s.session_id):
                yield (status, org, session)


def snapshot_position(s: states.SnapshotState) -> Position:
    return (micros(s.created_at), s.snapshot_id)


def snapshot_index() -> Index[states.SnapshotState]:
    return Index(snapshot_memberships, snapshot_position)
