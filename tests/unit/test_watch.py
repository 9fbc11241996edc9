"""Watching a directory: listings of real files by GNU find (as the sandbox takes them)
split from a stream and compared into inotify-like changes; bounds on what a sandbox sends."""

from __future__ import annotations

import os
import subprocess

import pytest

from sbx_api import errors
from services.executor import watch


def listing(root) -> bytes:
    out = subprocess.run(
        ["find", str(root), "-mindepth", "1", "-maxdepth", "64", "-printf", watch.RECORD],
        capture_output=True, check=True,
    )  # fmt: skip
    return out.stdout + b"E\0"


def kinds(before: bytes, after: bytes) -> list[tuple[str, str]]:
    (old, new), rest = watch.split(before + after)
    assert rest == b""
    return [(c.kind, c.name) for c in watch.changes(old, new)]


def test_changes_of_real_files_are_inotifys(tmp_path) -> None:
    (tmp_path / "kept").write_text("a")
    (tmp_path / "moved").write_text("m")
    (tmp_path / "gone").write_text("g")
    (tmp_path / "sub").mkdir()
    before = listing(tmp_path)
    with open(tmp_path / "kept", "a") as handle:
        handle.write("more")
    (tmp_path / "moved").rename(tmp_path / "sub" / "here")
    (tmp_path / "gone").unlink()
    (tmp_path / "new\nline").write_text("n")
    os.chmod(tmp_path / "sub", 0o700)
    assert kinds(before, listing(tmp_path)) == [
        ("create", "new\nline"),
        ("rename", "moved"),
        ("create", "sub/here"),
        ("remove", "gone"),
        ("write", "kept"),
        ("chmod", "sub"),
    ]
    assert kinds(listing(tmp_path), listing(tmp_path)) == []


def test_a_stream_of_listings_is_split_where_they_end() -> None:
    record = b"\0".join([b"7", b"f", b"644", b"1", b"1.5", b"E", b""])  # a file named E
    (first,), rest = watch.split(record + b"E\0" + record[:9])
    assert first == {"E": (7, "f", 0o644, 1, "1.5")}
    assert rest == record[:9]
    (second,), rest = watch.split(rest + record[9:] + b"E\0")
    assert second == first and rest == b""


@pytest.mark.parametrize(
    "fields",
    [[b"1", b"f", b"9z", b"1", b"1", b"a", b"E"], [b"x", b"f", b"644", b"1", b"1", b"a", b"E"]],
    ids=["mode", "inode"],
)
def test_a_malformed_listing_is_an_error(fields: list[bytes]) -> None:
    with pytest.raises(errors.InfrastructureError):
        watch.split(b"\0".join([*fields, b""]))


def test_bounds_on_entries_and_changes() -> None:
    many = b"".join(
        b"\0".join([b"%d" % i, b"f", b"644", b"0", b"1", b"n%d" % i, b""])
        for i in range(watch.ENTRIES_MAX + 1)
    )
    with pytest.raises(errors.LimitExceeded, match="more than 10000 entries"):
        watch.split(many + b"E\0")
    after = {f"n{i}": (i, "f", 0o644, 0, "1") for i in range(watch.CHANGES_MAX + 5)}
    assert len(watch.changes({}, after)) == watch.CHANGES_MAX
