"""The snapshot store's copy, as the local runtime makes it (no sandbox needed): a copy made
while its source changes, then refreshed, equals the source; layers are named by content."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from shared.contract import errors
from shared.runtime.local import snapstore


def tree(top: Path) -> None:
    (top / "d" / "e").mkdir(parents=True)
    (top / "a").write_text("a")
    (top / "d" / "b").write_text("b")
    (top / "d" / "e" / "c").write_text("c")
    (top / "link").symlink_to("a")
    (top / "gone").write_text("soon")
    (top / "becomes-dir").write_text("file")


def test_a_copy_refreshed_after_changes_equals_its_source(tmp_path):
    source, dest = tmp_path / "src", tmp_path / "copy"
    source.mkdir()
    tree(source)
    scanned = time.time_ns()
    notes = snapstore.scan(source)
    snapstore.copy_tree(source, dest)
    # Changes after the copy: content, a new file, a removal, a type change, a mode.
    (source / "d" / "b").write_text("b2")
    (source / "new").write_text("new")
    (source / "gone").unlink()
    (source / "becomes-dir").unlink()
    (source / "becomes-dir").mkdir()
    (source / "becomes-dir" / "x").write_text("x")
    os.chmod(source / "a", 0o600)
    os.mknod(source / "whiteout", 0o600 | 0o020000, os.makedev(0, 0))
    assert snapstore.tree_digest(dest) != snapstore.tree_digest(source)
    copied = snapstore.refresh(source, dest, notes, scanned)
    assert copied >= 5
    assert snapstore.tree_digest(dest) == snapstore.tree_digest(source)


def test_a_refresh_with_nothing_changed_copies_only_what_changed_just_before_the_scan(tmp_path):
    source, dest = tmp_path / "src", tmp_path / "copy"
    source.mkdir()
    tree(source)
    time.sleep(snapstore.CTIME_SLACK_NS / 1e9 + 0.02)
    scanned = time.time_ns()
    notes = snapstore.scan(source)
    snapstore.copy_tree(source, dest)
    assert snapstore.refresh(source, dest, notes, scanned) == 1  # the top directory alone
    (source / "a").write_text("changed just now")
    later = time.time_ns()
    notes = snapstore.scan(source)
    assert snapstore.refresh(source, dest, notes, later) >= 2  # recent: copied whatever its ctime
    assert (dest / "a").read_text() == "changed just now"


def test_layers_are_named_by_content_and_counted_against_the_budget(tmp_path):
    store = snapstore.SnapshotStore(tmp_path / "store", budget=10 * 1024**2)
    first = store.new_copy()
    tree(first)
    digest, size, entries, new = store.add(first)
    assert new and size > 0 and entries == 8 and store.bytes() == size
    second = store.new_copy()
    tree(second)
    assert store.add(second) == (digest, size, entries, False)  # equal content: the same layer
    assert not second.exists() and store.bytes() == size
    with pytest.raises(errors.LimitExceeded, match="SBX_SNAPSHOT_BUDGET"):
        store.check_room(10 * 1024**2)
    assert store.collect([digest]) == 0 and store.layer(digest).is_dir()
    assert store.collect([]) == size and not store.layer(digest).exists() and store.bytes() == 0
