"""A bucket's entries kept in list indexes (:mod:`shared.domain.listing`), so a list page
costs O(log n + page) instead of reading the bucket.

The bucket is followed (:mod:`shared.infrastructure.kvmirror`) from the first page asked
for: starting reads each key once (O(entries), once per process); after that every write
reaches the index as one message. A page waits until every write finished before it is in
the index (read-your-writes, one stream-info request); if the follower cannot catch up in
time, the page is built from a snapshot instead (slow, logged, never stale).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Generic

from shared.domain import listing, projections
from shared.infrastructure import projector


class Listing(Generic[projections.S]):
    def __init__(
        self,
        store: projector.ProjectionStore[projections.S],
        new_index: Callable[[], listing.Index[projections.S]],
    ) -> None:
        self.store: projector.ProjectionStore[projections.S] = store
        self.new_index: Callable[[], listing.Index[projections.S]] = new_index
        self.index: listing.Index[projections.S] = new_index()
        self._started = asyncio.Lock()
        self._following = False

    async def start(self) -> None:
        async with self._started:
            if not self._following:
                await self.store.follow(on_change=self._changed)
                self._following = True

    def _changed(self, old: projections.S | None, new: projections.S | None) -> None:
        if new is not None:
            self.index.put(new)
        elif old is not None:
            self.index.discard(old)

    async def page(
        self, selector: listing.Selector, *, after: listing.Position | None, limit: int
    ) -> listing.Page[projections.S]:
        await self.start()
        fallback = await self.store.sync()
        if fallback is None:
            return self.index.page(selector, after=after, limit=limit)
        index = self.new_index()
        for item in fallback.values():
            index.put(item)
        return index.page(selector, after=after, limit=limit)

    async def stop(self) -> None:
        await self.store.unfollow()
