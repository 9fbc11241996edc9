"""envd's pure parts: paths resolved as text, the executor's entries as envd's EntryInfo,
the listing records the executor parses (real ``find`` output, from real files), and
Connect's envelopes."""

from __future__ import annotations

import os
import subprocess

import pytest

from sbx_api import errors
from services.executor import files
from services.gateway.e2b import connect, entries
from shared.contract import execution


@pytest.mark.parametrize(
    ("given", "resolved"),
    [
        ("/tmp/x", "/tmp/x"),
        ("a/b", "/workspace/a/b"),
        ("~", "/workspace"),
        ("~/c", "/workspace/c"),
        ("/a/../../etc//passwd", "/etc/passwd"),  # text only: the sandbox resolves it
        ("x/../../..", "/"),
    ],
)
def test_paths_resolve_as_text_against_the_workspace(given: str, resolved: str) -> None:
    assert entries.resolve(given) == resolved


@pytest.mark.parametrize("bad", ["", "a\0b", "/" + "x" * 5000])
def test_bad_paths_are_refused(bad: str) -> None:
    with pytest.raises(errors.InvalidInput):
        entries.resolve(bad)


def test_entry_info_follows_protobufs_json_mapping() -> None:
    entry = execution.Entry(path="/w/d", kind="dir", mode=0o755, size=4096, mtime=1.5, owner="u", group="g")
    info = entries.entry_info(entry)
    assert info["type"] == "FILE_TYPE_DIRECTORY" and info["name"] == "d" and info["size"] == "4096"
    assert info["permissions"] == "drwxr-xr-x" and info["mode"] == (1 << 31) | 0o755
    assert info["modifiedTime"] == "1970-01-01T00:00:01.500000Z" and "isSymlink" not in info
    link = execution.Entry(path="/w/l", kind="symlink", target_kind="file", mode=0o777, target="/w/f")
    info = entries.entry_info(link)
    assert (info["type"], info["isSymlink"], info["symlinkTarget"]) == ("FILE_TYPE_FILE", True, "/w/f")
    assert info["permissions"] == "Lrwxrwxrwx"
    dangling = execution.Entry(path="/w/x", kind="symlink", target_kind="missing", target="nowhere")
    assert entries.entry_info(dangling)["type"] == "FILE_TYPE_SYMLINK"


def test_listing_records_of_real_files_parse(tmp_path) -> None:
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "f").write_bytes(b"12345")
    (tmp_path / "dir" / "name with\nnewline").write_text("")
    os.symlink("f", tmp_path / "dir" / "link")
    os.symlink("gone", tmp_path / "dir" / "dangling")
    raw = subprocess.run(
        ["find", str(tmp_path / "dir"), "-mindepth", "1", "-printf", files.RECORD],
        capture_output=True, check=True,
    ).stdout  # fmt: skip
    found = {os.path.basename(e.path): e for e in files.parse_entries(raw)}
    assert set(found) == {"f", "name with\nnewline", "link", "dangling"}
    assert (found["f"].kind, found["f"].size, found["f"].target) == ("file", 5, None)
    assert (found["link"].kind, found["link"].target_kind, found["link"].target) == ("symlink", "file", "f")
    assert found["dangling"].target_kind == "missing"
    assert found["f"].mode == (tmp_path / "dir" / "f").stat().st_mode & 0o7777
    assert len(files.parse_entries(raw, limit=2)) == 2


@pytest.mark.parametrize(
    "raw",
    [b"f\0f\0644\0", b"f\0f\0999\x001\x001.0\0u\0g\0/p\0\0", b"f\0f\0644\0x\x001.0\0u\0g\0/p\0\0"],
)
def test_malformed_records_are_errors(raw: bytes) -> None:
    with pytest.raises(errors.InfrastructureError):
        files.parse_entries(raw)


def test_file_requests_are_checked_before_anything_runs() -> None:
    base = dict(session_id="s", sandbox_id="b")
    assert files.validate(execution.Files(**base, action="move", path="/a/./b", destination="/c//d")) == (
        "/a/b",
        "/c/d",
    )
    for bad in (
        execution.Files(**base, action="move", path="/a"),
        execution.Files(**base, action="remove", path="/"),
        execution.Files(**base, action="list", path="/a", depth=0),
        execution.Files(**base, action="list", path="/a", depth=execution.DEPTH_MAX + 1),
        execution.Files(**base, action="stat", path="relative"),
    ):
        with pytest.raises(errors.InvalidInput):
            files.validate(bad)


def test_connect_envelopes() -> None:
    assert connect.unenvelope(connect.envelope(b"{}")) == b"{}"
    for bad in (b"", b"\x01\0\0\0\x02{}", b"\0\0\0\0\x05{}"):
        with pytest.raises(connect.ConnectError):
            connect.unenvelope(bad)
    assert connect.from_error(errors.NotFound("x")).code == "not_found"
    assert connect.from_error(errors.LimitExceeded("x")).code == "resource_exhausted"
