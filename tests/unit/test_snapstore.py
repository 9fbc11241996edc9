"""The snapshot store's copy, as the local runtime makes it (no sandbox needed): a copy made
while its source changes, then refreshed, equals the source; layers are named by content."""

from __future__ import annotations

import os
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from shared.contract import errors
from shared.runtime import api
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


def _record(snapshot_id: str):
    def make(added: snapstore.Added) -> api.SnapshotInfo:
        return api.SnapshotInfo(
            snapshot_id=snapshot_id,
            sandbox_id="sb-1",
            digest=snapstore.snapshot_digest([added.digest]),
            layers=(added.digest,),
            parent=None,
            size=added.size,
            total_size=added.size,
            files=added.entries,
            image="default",
            image_digest=None,
            run_as_root=True,
            writable_root=True,
            created_at=datetime.now(UTC),
            frozen_seconds=0.0,
        )

    return make


def test_layers_are_named_by_content_shared_and_counted_against_the_budget(tmp_path):
    store = snapstore.SnapshotStore(tmp_path / "store", budget=10 * 1024**2)
    first = store.new_copy()
    tree(first)
    one = store.add(first, _record("one"))
    (digest,) = one.layers
    assert one.size > 0 and one.files == 8 and store.bytes() == one.size and store.get("one") == one
    second = store.new_copy()
    tree(second)
    two = store.add(second, _record("two"))
    assert two.layers == one.layers and two.size == 0  # equal content: the same layer
    assert not second.exists() and store.bytes() == one.size
    with pytest.raises(errors.LimitExceeded, match="SBX_SNAPSHOT_BUDGET"):
        store.check_room(10 * 1024**2)
    assert store.forget("one") and store.collect(lambda: []) == 0  # "two" still names it
    assert store.forget("two") and store.collect(lambda: [digest]) == 0  # a sandbox does
    assert store.collect(lambda: []) == one.size and not store.layer(digest).exists()
    assert store.bytes() == 0


def test_another_processs_copy_in_progress_is_left_alone(tmp_path):
    root = tmp_path / "store"
    store = snapstore.SnapshotStore(root, budget=1024**2)
    mine = store.new_copy()
    dead = root / "tmp" / "999999999.1.abc"
    dead.mkdir()
    snapstore.SnapshotStore(root, budget=1024**2)  # another service starts
    assert mine.exists() and not dead.exists()
