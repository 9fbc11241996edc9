"""Two-way sync (clients/python/sbx_client/sync.py): manifests, diffs and pull-back onto the host, attacked
with what a sandbox could send back: symlinks that leave the code dir, a planted hook and
config in .git, a gitfile, an embedded bare repository; plus binary and large files,
deletions, mode bits and a 10k-file tree."""

from __future__ import annotations

import os
import shutil
import time

import pytest

from sbx_client import sync


def pull_back(host, sandbox):
    """The whole round: what changed in the sandbox copy, applied on the host."""
    before, after = sync.scan(host), sync.scan(sandbox)
    changes = sync.diff(before, after)
    return sync.apply(host, changes, after, lambda p: (sandbox / p).read_bytes())


@pytest.fixture
def trees(tmp_path):
    host = tmp_path / "host"
    (host / ".git" / "hooks").mkdir(parents=True)
    (host / ".git" / "config").write_text("[core]\n\tbare = false\n")
    (host / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (host / "src").mkdir()
    (host / "src" / "app.py").write_text("print('v1')\n")
    (host / "run.sh").write_text("#!/bin/sh\n")
    (tmp_path / "outside").mkdir()
    sandbox = tmp_path / "sandbox"
    shutil.copytree(host, sandbox, symlinks=True)
    return host, sandbox, tmp_path / "outside"


def test_created_changed_and_deleted_files_come_back_with_mode_bits(trees):
    host, sandbox, _ = trees
    (sandbox / "src" / "app.py").write_text("print('v2')\n")
    (sandbox / "run.sh").chmod(0o755)
    (sandbox / "src" / "new").mkdir()
    blob = os.urandom(3 << 20) + b"\x00\xff"
    (sandbox / "src" / "new" / "data.bin").write_bytes(blob)
    (sandbox / "src" / "gone.txt").write_text("x")
    report = pull_back(host, sandbox)
    assert not report.refused
    assert (host / "src" / "app.py").read_text() == "print('v2')\n"
    assert (host / "run.sh").stat().st_mode & 0o777 == 0o755
    assert (host / "src" / "new" / "data.bin").read_bytes() == blob
    (sandbox / "src" / "gone.txt").unlink()
    (sandbox / "src" / "app.py").unlink()
    report = pull_back(host, sandbox)
    assert sorted(report.deleted) == ["src/app.py", "src/gone.txt"]
    assert not (host / "src" / "app.py").exists()


def test_hooks_and_config_planted_in_git_stay_as_the_host_has_them(trees):
    host, sandbox, _ = trees
    (sandbox / ".git" / "hooks" / "pre-push").write_text("#!/bin/sh\ncurl evil\n")
    (sandbox / ".git" / "config").write_text("[core]\n\tfsmonitor = evil\n")
    (sandbox / ".git" / "objects" / "ab").mkdir(parents=True)
    (sandbox / ".git" / "objects" / "ab" / "cdef").write_bytes(b"not an object name")
    loose = "cd" * 19
    (sandbox / ".git" / "objects" / "ab" / loose).write_bytes(b"object")
    (sandbox / ".git" / "objects" / "info").mkdir()
    (sandbox / ".git" / "objects" / "info" / "alternates").write_text("/home/u/private/.git/objects\n")
    (sandbox / ".git" / "refs" / "heads").mkdir(parents=True)
    (sandbox / ".git" / "refs" / "heads" / "main").write_text("abcdef\n")
    (sandbox / ".git" / "index").write_bytes(b"DIRC")
    (sandbox / ".git" / "info").mkdir()
    (sandbox / ".git" / "info" / "attributes").write_text("* filter=evil\n")
    report = pull_back(host, sandbox)
    refused = dict(report.refused)
    assert set(refused) == {
        ".git/hooks/pre-push", ".git/config", ".git/info", ".git/info/attributes", ".git/objects/ab/cdef",
        ".git/objects/info", ".git/objects/info/alternates", f".git/objects/ab/{loose}",
    }  # fmt: skip
    assert (
        "does not hash" in refused[f".git/objects/ab/{loose}"]
        or "zlib" in refused[f".git/objects/ab/{loose}"]
    )
    assert not (host / ".git" / "hooks" / "pre-push").exists()
    assert "fsmonitor" not in (host / ".git" / "config").read_text()
    assert not (host / ".git" / "objects" / "ab" / loose).exists()  # not an object: its name is no hash of it
    assert not (host / ".git" / "objects" / "info" / "alternates").exists()
    assert (host / ".git" / "refs" / "heads" / "main").read_text() == "abcdef\n"
    assert (host / ".git" / "index").read_bytes() == b"DIRC"


def test_a_gitfile_or_a_linked_git_dir_never_replaces_the_hosts(trees, tmp_path):
    host, sandbox, outside = trees
    nested = sandbox / "vendor" / "lib"
    nested.mkdir(parents=True)
    (nested / ".git").write_text(f"gitdir: {outside}\n")
    report = pull_back(host, sandbox)
    assert (
        "vendor/lib/.git",
        ".git is not a directory (a gitfile or link stays as the host has it)",
    ) in report.refused
    assert not (host / "vendor" / "lib" / ".git").exists()


def test_symlinks_that_leave_the_code_dir_never_come_back_and_are_never_written_through(trees):
    host, sandbox, outside = trees
    os.symlink(outside, sandbox / "escape")
    os.symlink("../../outside/x", sandbox / "src" / "relative-escape")
    os.symlink("app.py", sandbox / "src" / "fine-link")  # into its own directory: fine
    report = pull_back(host, sandbox)
    refused = dict(report.refused)
    assert "escape" in refused and "src/relative-escape" in refused
    assert os.readlink(host / "src" / "fine-link") == "app.py"
    # The host has a symlink where the sandbox has a directory of that name: the whole
    # round replaces the link with a real directory, and nothing lands outside.
    os.symlink(outside, host / "planted")
    (sandbox / "planted").mkdir()
    (sandbox / "planted" / "payload").write_text("pwned")
    pull_back(host, sandbox)
    assert (host / "planted").is_dir() and not (host / "planted").is_symlink()
    assert list(outside.iterdir()) == [], "nothing was written outside the code dir"
    # A change list that names only the file below a host symlink (a stale or forged
    # diff) is refused, never written through the link.
    os.symlink(outside, host / "planted2")
    entries = {"planted2/payload": sync.Entry("file", mode=0o644, digest="x", size=5)}
    report = sync.apply(host, sync.Changes(upsert=["planted2/payload"]), entries, lambda p: b"pwned")
    assert "planted2/payload" in dict(report.refused)
    report = sync.apply(host, sync.Changes(delete=["planted2/victim"]), {}, lambda p: b"")
    (outside / "victim").write_text("keep")
    report = sync.apply(host, sync.Changes(delete=["planted2/victim"]), {}, lambda p: b"")
    assert "planted2/victim" in dict(report.refused) and (outside / "victim").exists()
    (outside / "victim").unlink()
    assert list(outside.iterdir()) == [], "nothing was written outside the code dir"


def test_an_embedded_bare_repository_is_just_files_and_its_hooks_are_inert(trees):
    host, sandbox, _ = trees
    bare = sandbox / "embedded.git"
    for sub in ("objects", "refs", "hooks"):
        (bare / sub).mkdir(parents=True)
    (bare / "HEAD").write_text("ref: refs/heads/main\n")
    (bare / "config").write_text("[core]\n\tbare = true\n\tfsmonitor = evil\n")
    (bare / "hooks" / "post-checkout").write_text("#!/bin/sh\nevil\n")
    report = pull_back(host, sandbox)
    assert not report.refused
    # It comes back as plain files; host-side git never uses it (safe.bareRepository=explicit
    # and an explicit --git-dir: tests/unit/test_hostrun.py).
    assert (host / "embedded.git" / "HEAD").exists()


def test_an_unchanged_10k_file_tree_costs_one_lstat_per_file(tmp_path):
    root = tmp_path / "big"
    for d in range(100):
        folder = root / f"d{d:03}"
        folder.mkdir(parents=True)
        for f in range(100):
            (folder / f"f{f:03}.txt").write_text(f"{d}-{f}\n")
    cache: dict = {}
    first = sync.scan(root, cache=cache)
    assert sum(1 for e in first.values() if e.kind == "file") == 10_000
    t0 = time.perf_counter()
    second = sync.scan(root, cache=cache)
    cached = time.perf_counter() - t0
    assert sync.diff(first, second).upsert == [] and not sync.diff(first, second)
    (root / "d050" / "f050.txt").write_text("changed\n")
    third = sync.scan(root, cache=cache)
    assert sync.diff(second, third).upsert == ["d050/f050.txt"]
    print(f"10k files, cached rescan: {cached * 1000:.0f} ms")


def test_excludes_keep_build_output_and_environments_out():
    assert sync.excluded("node_modules/x/index.js", sync.DEFAULT_EXCLUDES)
    assert sync.excluded("pkg/__pycache__/m.cpython-311.pyc", sync.DEFAULT_EXCLUDES)
    assert not sync.excluded("src/node_modules_helper.py", sync.DEFAULT_EXCLUDES)


def test_git_look_alikes_modes_and_upward_links_are_refused(trees):
    host, sandbox, outside = trees
    for name in (".GIT", ".Git", ".git.", "git~1"):
        (sandbox / name).mkdir()
        (sandbox / name / "config").write_text("[core]\n\tsshCommand = evil\n")
    (sandbox / "d" / "e").mkdir(parents=True)
    os.symlink("../..", sandbox / "d" / "e" / "s")
    os.symlink("d/e/s/../../outside", sandbox / "L")
    (sandbox / "setuid").write_text("x")
    (sandbox / "setuid").chmod(0o4777)
    (sandbox / "open").mkdir()
    (sandbox / "open").chmod(0o777)
    report = pull_back(host, sandbox)
    refused = dict(report.refused)
    for name in (".GIT", ".Git", ".git.", "git~1"):
        assert name in refused and not (host / name).exists()
    assert "d/e/s" in refused and "L" in refused
    assert (host / "setuid").stat().st_mode & 0o7777 == 0o755
    assert (host / "open").stat().st_mode & 0o777 == 0o755


def test_one_path_that_cannot_be_applied_is_refused_and_the_rest_still_comes_back(trees):
    host, sandbox, _ = trees
    entries = {
        "x" * 300: sync.Entry("file", mode=0o644, digest="d", size=1),
        "fine.txt": sync.Entry("file", mode=0o644, digest="d", size=2),
    }
    changes = sync.Changes(upsert=["x" * 300, "fine.txt", "missing-from-manifest"])
    report = sync.apply(host, changes, entries, lambda p: b"ok")
    refused = dict(report.refused)
    assert "could not be applied" in refused["x" * 300]
    assert "not in the sandbox's manifest" in refused["missing-from-manifest"]
    assert report.written == ["fine.txt"] and (host / "fine.txt").read_bytes() == b"ok"
