"""Copying a tree a sandbox controls by descriptor (no sandbox needed): a copy refreshed
after changes equals its source; links, whiteouts, hard links, holes and ``user.*``
attributes are kept; a directory swapped for a link to a host directory between the
copy's look and its open is never entered; trees too deep are refused; the guard can stop
a copy."""

from __future__ import annotations

import os
import socket
import stat
import time
from pathlib import Path

import pytest

from sbx_api import errors
from shared.runtime.local import fdtree
from shared.runtime.local.snapstore import tree_digest


def tree(top: Path) -> None:
    (top / "d" / "e").mkdir(parents=True)
    (top / "a").write_text("a")
    (top / "d" / "b").write_text("b")
    (top / "d" / "e" / "c").write_text("c")
    (top / "link").symlink_to("a")
    (top / "gone").write_text("soon")
    (top / "becomes-dir").write_text("file")
    os.mknod(top / "whiteout", 0o600 | stat.S_IFCHR, os.makedev(0, 0))
    os.mkfifo(top / "fifo")
    os.link(top / "a", top / "d" / "hard-a")
    os.setxattr(top / "d", "user.overlay.opaque", b"y")


def test_a_copy_refreshed_after_changes_equals_its_source(tmp_path):
    source, dest = tmp_path / "src", tmp_path / "copy"
    source.mkdir()
    tree(source)
    started = time.time_ns()
    first = fdtree.sync(source, dest)
    assert tree_digest(dest) == tree_digest(source)
    assert os.stat(dest / "a").st_ino == os.stat(dest / "d" / "hard-a").st_ino  # a hard link stays one
    assert os.getxattr(dest / "d", "user.overlay.opaque") == b"y"
    # Changes after the copy: content, a new file, a removal, a type change, a mode, an xattr gone.
    (source / "d" / "b").write_text("b2")
    (source / "new").write_text("new")
    (source / "gone").unlink()
    (source / "becomes-dir").unlink()
    (source / "becomes-dir").mkdir()
    (source / "becomes-dir" / "x").write_text("x")
    os.chmod(source / "a", 0o600)
    os.removexattr(source / "d", "user.overlay.opaque")
    assert tree_digest(dest) != tree_digest(source)
    again = fdtree.sync(source, dest, before=first.notes, recent_ns=started - fdtree.CTIME_SLACK_NS)
    assert again.written >= 5
    assert tree_digest(dest) == tree_digest(source)


def test_a_refresh_with_nothing_changed_writes_nothing(tmp_path):
    source, dest = tmp_path / "src", tmp_path / "copy"
    source.mkdir()
    tree(source)
    time.sleep(fdtree.CTIME_SLACK_NS / 1e9 + 0.02)
    started = time.time_ns()
    first = fdtree.sync(source, dest)
    assert (
        fdtree.sync(source, dest, before=first.notes, recent_ns=started - fdtree.CTIME_SLACK_NS).written == 0
    )
    (source / "a").write_text("changed just now")
    later = time.time_ns()
    # recent: copied whatever its ctime says (and its hard link, whose ctime moved with it)
    assert fdtree.sync(source, dest, before=first.notes, recent_ns=later).written >= 2
    assert (dest / "a").read_text() == "changed just now"


def test_sparse_files_stay_sparse_and_are_measured_by_what_was_written(tmp_path):
    source, dest = tmp_path / "src", tmp_path / "copy"
    source.mkdir()
    with open(source / "sparse", "wb") as f:
        f.truncate(1 << 30)  # 1 GiB, nothing written
        f.seek(1 << 20)
        f.write(b"x" * 4096)
    assert fdtree.measure(source).bytes < 1 << 20
    copy = fdtree.sync(source, dest)
    assert copy.bytes == 4096
    st = os.stat(dest / "sparse")
    assert st.st_size == 1 << 30 and st.st_blocks * 512 < 1 << 20
    with open(dest / "sparse", "rb") as f:
        f.seek(1 << 20)
        assert f.read(4096) == b"x" * 4096


def test_links_are_copied_as_links_and_never_followed(tmp_path):
    source, dest, host = tmp_path / "src", tmp_path / "copy", tmp_path / "host"
    source.mkdir()
    host.mkdir()
    (host / "secret").write_text("host secret")
    (source / "to-dir").symlink_to(host)
    (source / "to-file").symlink_to(host / "secret")
    fdtree.sync(source, dest)
    assert os.readlink(dest / "to-dir") == str(host) and os.readlink(dest / "to-file") == str(host / "secret")
    assert fdtree.measure(source).entries == 2
    top_link = tmp_path / "top-link"
    top_link.symlink_to(host)
    fdtree.sync(top_link, tmp_path / "copy-of-link")  # the top itself a link: an empty copy
    assert os.listdir(tmp_path / "copy-of-link") == []


def test_a_directory_swapped_for_a_link_between_look_and_open_is_not_entered(tmp_path, monkeypatch):
    """What ``renameat2(RENAME_EXCHANGE)`` does to a copy at the worst moment: the entry is
    a directory when looked at and a link to a host directory when opened."""
    source, dest, host = tmp_path / "src", tmp_path / "copy", tmp_path / "host"
    (source / "d").mkdir(parents=True)
    (source / "d" / "mine").write_text("mine")
    host.mkdir()
    (host / "secret").write_text("host secret")
    looked = fdtree._entry

    def swapping(dir_fd: int, name: str) -> os.stat_result | None:
        st = looked(dir_fd, name)
        if name == "d" and not (source / "d").is_symlink():
            (source / "d").rename(source / "real-d")
            (source / "d").symlink_to(host)
        return st

    monkeypatch.setattr(fdtree, "_entry", swapping)
    copy = fdtree.sync(source, dest)
    monkeypatch.undo()
    top = os.stat(source)
    assert (
        fdtree._key(top, "d") not in copy.notes and fdtree._key(top, "a") not in copy.notes
    )  # left to the refresh
    found = [p.read_text() for p in dest.rglob("*") if p.is_file() and not p.is_symlink()]
    assert "host secret" not in found
    fdtree.sync(source, dest, before=copy.notes, recent_ns=0)
    assert os.readlink(dest / "d") == str(host) and (dest / "real-d" / "mine").read_text() == "mine"


def test_sockets_and_devices_are_left_out(tmp_path):
    source, dest = tmp_path / "src", tmp_path / "copy"
    source.mkdir()
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(source / "sock"))
    os.mknod(source / "null", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    os.mknod(source / "disk", 0o600 | stat.S_IFBLK, os.makedev(7, 0))
    try:
        fdtree.sync(source, dest)
    finally:
        sock.close()
    assert os.listdir(dest) == []


def test_a_tree_too_deep_is_refused(tmp_path):
    source = tmp_path / "src"
    fd = os.open(tmp_path, os.O_RDONLY)
    os.mkdir("src", dir_fd=fd)
    for _ in range(fdtree.MAX_DEPTH + 1):  # (deeper than a path can say: made by descriptor)
        sub = os.open("src" if _ == 0 else "x", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        os.mkdir("x", dir_fd=sub)
        fd = sub
    os.close(fd)
    with pytest.raises(errors.LimitExceeded, match="levels deep"):
        fdtree.measure(source)
    with pytest.raises(errors.LimitExceeded, match="levels deep"):
        fdtree.sync(source, tmp_path / "copy")


def test_the_guard_stops_a_copy(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    (source / "big").write_bytes(b"x" * (3 << 20))
    seen = []

    def guard(size: int, entries: int) -> None:
        seen.append(size)
        if sum(seen) > 1 << 20:
            raise errors.LimitExceeded("full")

    with pytest.raises(errors.LimitExceeded, match="full"):
        fdtree.sync(source, tmp_path / "copy", guard=guard)
    assert sum(seen) <= 2 << 20


def test_read_file_reads_only_through_real_directories(tmp_path):
    (tmp_path / "top" / "shell").mkdir(parents=True)
    (tmp_path / "top" / "shell" / "cwd").write_text("/workspace")
    found = fdtree.read_file(tmp_path / "top", ("shell", "cwd"), 100)
    assert found is not None and found[0] == b"/workspace"
    assert fdtree.read_file(tmp_path / "top", ("shell", "cwd"), 5) is None  # too big
    assert fdtree.read_file(tmp_path / "top", ("nope", "cwd"), 100) is None


def test_a_directory_moved_into_what_is_still_to_walk_is_walked_once(tmp_path, monkeypatch):
    """A sandbox that moves a walked subtree into the next sibling the host has not listed
    yet would have it walked again for every sibling (K x M entries from K + M)."""
    source = tmp_path / "src"
    (source / "s").mkdir(parents=True)
    for n in range(20):
        (source / "s" / f"f{n}").write_text("x")
    for n in range(3):
        (source / f"z{n}").mkdir()
    listed = fdtree._names

    def moving(dir_fd: int) -> list[str]:
        ino = os.fstat(dir_fd).st_ino
        for n in range(3):  # entering z<n>: the subtree is moved in just before it is listed
            if ino == os.stat(source / f"z{n}").st_ino:
                os.rename(source / ("s" if n == 0 else f"z{n - 1}/s"), source / f"z{n}" / "s")
        return sorted(listed(dir_fd))

    monkeypatch.setattr(fdtree, "_names", moving)
    assert fdtree.measure(source).entries <= 20 + 1 + 3 + 3
    (source / "z2" / "s").rename(source / "s")
    copy = fdtree.sync(source, tmp_path / "copy")
    assert copy.written <= 20 + 1 + 3 + 3


def test_set_id_bits_are_dropped_from_files_and_hard_links_count_once(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    (source / "tool").write_bytes(b"x" * 40000)
    os.chmod(source / "tool", 0o6755)
    (source / "shared").mkdir()
    os.chmod(source / "shared", 0o2775)
    for n in range(10):
        os.link(source / "tool", source / f"name{n}")
    tally = fdtree.measure(source)
    assert tally.entries == 12 and tally.bytes < 2 * 40960 + 2 * fdtree.BLOCK
    fdtree.sync(source, tmp_path / "copy")
    assert stat.S_IMODE(os.stat(tmp_path / "copy" / "tool").st_mode) == 0o755
    assert (
        stat.S_IMODE(os.stat(tmp_path / "copy" / "shared").st_mode) == 0o2775
    )  # (a directory's setgid: kept)


def test_a_tree_of_too_many_entries_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(fdtree, "MAX_ENTRIES", 50)
    source = tmp_path / "src"
    source.mkdir()
    for n in range(60):
        (source / f"f{n}").touch()
    with pytest.raises(errors.LimitExceeded, match="more than 50 entries"):
        fdtree.measure(source)
    with pytest.raises(errors.LimitExceeded, match="more than 50 entries"):
        fdtree.sync(source, tmp_path / "copy")
