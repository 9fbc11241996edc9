"""envd's pure parts: paths resolved as text, the executor's entries as envd's EntryInfo,
the listing records the executor parses (real ``find`` output, from real files), Connect's
envelopes, and processes: start requests, job labels, end events."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from sbx_api import errors, hostapi
from services.executor import files, jobs, scripts
from services.gateway.e2b import connect, entries, processes
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


def test_a_start_request_is_bash_or_refused() -> None:
    start = lambda **kw: processes.StartRequest(**kw)  # noqa: E731
    bash = processes.ProcessConfig(cmd="/bin/bash", args=["-l", "-c", "echo hi"])
    assert processes.command_of(start(process=bash)) == "echo hi"
    for bad in (
        start(process=processes.ProcessConfig(cmd="/bin/sh", args=["-c", "x"])),
        start(process=bash, pty={"size": {"rows": 1, "cols": 1}}),
    ):
        with pytest.raises(connect.ConnectError) as refused:
            processes.command_of(bad)
        assert refused.value.code == "unimplemented"


def test_a_jobs_label_lists_it_as_started_and_stays_bounded() -> None:
    config = processes.ProcessConfig(cmd="/bin/bash", args=["-l", "-c", "x"], envs={"A": "1"}, cwd="/tmp")
    label = processes.label_of(processes.StartRequest(process=config, tag="t"))
    info = processes.listed(execution.JobInfo(job_id="a" * 32, pid=7, label=label))
    assert info == {
        "config": {"cmd": "/bin/bash", "args": ["-l", "-c", "x"], "envs": {"A": "1"}, "cwd": "/tmp"},
        "pid": 7,
        "tag": "t",
    }
    huge = processes.ProcessConfig(cmd="/bin/bash", args=["-l", "-c", "x"], envs={"B": "v" * 20_000})
    bounded = processes.label_of(processes.StartRequest(process=huge))
    assert len(bounded.encode()) <= execution.LABEL_MAX and "envs" not in bounded  # the envs go first
    ours = processes.listed(execution.JobInfo(job_id="b" * 32, pid=8, label="not json"))
    assert ours["pid"] == 8 and "tag" not in ours


def test_a_jobs_end_as_envds_end_event() -> None:
    def end(**kw) -> dict:
        raw = processes.ended(hostapi.End(**kw))
        return json.loads(connect.unenvelope(raw))["event"]["end"]

    assert end(exit_code=3, message="exited") == {"exitCode": 3, "exited": True, "status": "exit status 3"}
    assert end(message="stopped")["status"] == "signal: killed" and end(message="stopped")["exitCode"] == -1
    assert end(message="lost")["exited"] is False


def test_the_job_listing_keeps_only_well_formed_jobs() -> None:
    good, other = "a" * 32, "b" * 32
    fields = [good, "123", "{}", "../x", "456", "label", other, "nope", "l"]
    raw = "".join(f + "\x00" for f in fields).encode() + b"\xff\x00"
    assert scripts.parse_jobs(raw) == [execution.JobInfo(job_id=good, pid=123, label="{}")]
    assert scripts.parse_jobs(b"") == [] and scripts.parse_jobs(b"\0\0") == []


def test_job_start_arguments_are_checked_before_anything_runs() -> None:
    base = dict(session_id="s", sandbox_id="b", command="true")
    args = jobs.start_args(
        execution.ShellAsync(**base, cwd="/tmp/./x", env={"A": "1 2"}, stdin=True), "c" * 32
    )
    assert args == ["c" * 32, "/tmp/x", "s", "", "A=1 2"]
    for bad in (
        execution.ShellAsync(**base, cwd="relative"),
        execution.ShellAsync(**base, env={"A=B": "1"}),
        execution.ShellAsync(**base, env={"A": "\0"}),
        execution.ShellAsync(**base, label="x" * (execution.LABEL_MAX + 1)),
        execution.ShellAsync(session_id="s", sandbox_id="b", command="   "),
    ):
        with pytest.raises(errors.InvalidInput):
            jobs.start_args(bad, "d" * 32)
