"""The bounded dict the executor remembers sandboxes in (shared.infrastructure.bounded)."""

from __future__ import annotations

from shared.infrastructure.bounded import Bounded


def test_only_the_newest_entries_are_kept() -> None:
    seen: Bounded[str, int] = Bounded(3)
    for i in range(10):
        seen[f"k{i}"] = i
    assert list(seen.items()) == [("k7", 7), ("k8", 8), ("k9", 9)]


def test_updating_an_entry_keeps_its_place_and_evicts_nothing() -> None:
    seen: Bounded[str, int] = Bounded(2)
    seen["a"], seen["b"] = 1, 2
    seen["a"] = 3
    assert list(seen.items()) == [("a", 3), ("b", 2)]
    seen["c"] = 4
    assert list(seen) == ["b", "c"]
