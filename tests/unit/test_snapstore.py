"""The snapshot store's copy, as the local runtime makes it (no sandbox needed): a copy made
while its source changes, then refreshed, equals the source; layers are named by content."""

from __future__ import annotations

import os
from datetime import UTC, datetime
from pathlib import Path

import pytest

from sbx_api import errors
from shared.runtime import api
from shared.runtime.local import fdtree, snapstore


def tree(top: Path) -> None:
    (top / "d" / "e").mkdir(parents=True)
    (top / "a").write_text("a")
    (top / "d" / "b").write_text("b")
    (top / "d" / "e" / "c").write_text("c")
    (top / "link").symlink_to("a")
    (top / "gone").write_text("soon")
    (top / "becomes-dir").write_text("file")


def test_a_layers_digest_is_all_it_keeps(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    tree(one)
    fdtree.sync(one, two)  # (times kept)
    assert snapstore.tree_digest(one) == snapstore.tree_digest(two)
    st = os.stat(two / "d" / "b")
    os.utime(two / "d" / "b", ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # a time alone
    assert snapstore.tree_digest(one) != snapstore.tree_digest(two)
    os.utime(two / "d" / "b", ns=(st.st_atime_ns, st.st_mtime_ns))
    os.setxattr(two / "a", "user.note", b"mine")  # an attribute alone
    assert snapstore.tree_digest(one) != snapstore.tree_digest(two)
    os.removexattr(two / "a", "user.note")
    assert snapstore.tree_digest(one) == snapstore.tree_digest(two)
    (two / "d" / "b").write_text("B")
    assert snapstore.tree_digest(one) != snapstore.tree_digest(two)


def test_a_shell_file_is_read_only_through_real_directories(tmp_path):
    control, host = tmp_path / "control", tmp_path / "host"
    (control / "shell").mkdir(parents=True)
    host.mkdir()
    (host / "cwd").write_text("/etc/host-secret")
    (control / "shell" / "env").write_text("export A=1\n")
    (control / "shell" / "cwd").symlink_to(host / "cwd")
    out = tmp_path / "copy"
    out.mkdir()
    assert snapstore.copy_shell_file(control, "env", out / "shell" / "env")
    assert (out / "shell" / "env").read_text() == "export A=1\n"
    assert not snapstore.copy_shell_file(control, "cwd", out / "shell" / "cwd")
    (control / "shell" / "env").unlink()
    (control / "shell").rename(control / "was")
    (control / "shell").symlink_to(host)
    assert not snapstore.copy_shell_file(control, "cwd", out / "shell" / "cwd")
    assert not (out / "shell" / "cwd").exists()


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
    second.rmdir()
    fdtree.sync(store.layer(digest), second)  # equal to the last attribute
    two = store.add(second, _record("two"))
    assert two.layers == one.layers and two.size == 0  # equal content: the same layer
    assert not second.exists() and store.bytes() == one.size
    with pytest.raises(errors.LimitExceeded, match="SBX_SNAPSHOT_BUDGET"):
        with store.reserving(10 * 1024**2):
            pass
    with store.reserving(4 * 1024**2) as may_write:  # held while a snapshot is made...
        assert may_write <= 10 * 1024**2 - store.bytes()
        with pytest.raises(errors.LimitExceeded, match="SBX_SNAPSHOT_BUDGET"):
            with store.reserving(6 * 1024**2):  # ...so another made meanwhile counts it
                pass
    with store.reserving(6 * 1024**2):  # (released once made)
        pass
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
