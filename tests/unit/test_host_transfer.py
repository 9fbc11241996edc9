"""The host API's pure parts: frames, listings, what a round of sync moves, tar streams
both ways (the sandbox's tar is untrusted), and the executor's input checks."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from sbx_api import errors, hostapi
from sbx_client import archive, changes, sync
from services.executor import streamed
from shared.contract import execution


def test_frames_survive_any_split():
    stream = hostapi.frame(b"o", b"hello") + hostapi.frame(b"l", b"") + hostapi.frame(b"x", b"{}")
    reader = hostapi.FrameReader()
    got = [frame for byte in stream for frame in reader.feed(bytes([byte]))]
    assert got == [(b"o", b"hello"), (b"l", b""), (b"x", b"{}")]
    assert reader.pending == 0


@pytest.mark.parametrize("bad", [b"Z\x00\x00\x00\x00", b"o\xff\xff\xff\xff"])
def test_unknown_channels_and_huge_frames_are_refused(bad):
    with pytest.raises(errors.InvalidInput):
        list(hostapi.FrameReader().feed(bad))


def _record(kind, path, target="", mode="644", size="1", mtime="1.5", ctime="1.5", inode="7"):
    return f"{kind} {mode} {size} {mtime} {ctime} {inode} {path}\0{target}\0".encode()


def test_listings_parse_names_with_spaces_newlines_and_links():
    data = _record("f", "a b.txt") + _record("d", "dir", mode="755") + _record("l", "ln", target="a b.txt")
    data += _record("f", "new\nline")
    parsed = hostapi.parse_listing(data)
    assert parsed["a b.txt"].kind == "f" and parsed["a b.txt"].mode == 0o644
    assert parsed["ln"].target == "a b.txt"
    assert "new\nline" in parsed


@pytest.mark.parametrize("bad", [b"f 644 1 1 1 7 x\0", b"f 6x4 1 1 1 7 x\0\0", b"f 644\0\0"])
def test_malformed_listings_are_refused(bad):
    with pytest.raises(errors.InvalidInput):
        hostapi.parse_listing(bad)


@pytest.mark.parametrize("root", ["/workspace/a", "/workspace", "/workspace/a/b"])
def test_roots_under_the_workspace_pass(root):
    assert hostapi.validate_root(root) == root


@pytest.mark.parametrize(
    "root", ["/etc", "workspace/a", "/workspace/../etc", "/workspace/a/..", "/workspaces", "/x\0"]
)
def test_other_roots_are_refused(root):
    with pytest.raises(errors.InvalidInput):
        hostapi.validate_root(root)


@pytest.mark.parametrize("path", ["", "/abs", "a/../b", "./a", "a//b", "a\0", "a\nb", ".."])
def test_paths_must_be_plain_and_relative(path):
    with pytest.raises(errors.InvalidInput):
        hostapi.validate_relative(path)


# ---- what moves --------------------------------------------------------------------------------


def stat_(kind="f", size=1, mtime="1", mode=0o644, target=""):
    return hostapi.Stat(kind, mode, size, mtime, mtime, "1", target)


def test_pull_back_is_what_changed_between_the_listings():
    before = {"a": stat_(), "d": stat_("d", mode=0o755), "d/x": stat_(), "gone": stat_(), "same": stat_()}
    after = {
        "a": stat_(size=2),
        "d": stat_("d", mtime="9", mode=0o755),  # a directory's times change with its children
        "d/x": stat_(),
        "new": stat_(),
        "same": stat_(),
        "node_modules": stat_("d", mode=0o755),
        "x.pyc": stat_(),
        ".git/config": stat_(size=9),
    }
    plan = changes.pull_back(before, after, excludes=sync.DEFAULT_EXCLUDES)
    assert plan.upsert == ["a", "new"]
    assert plan.delete == ["gone"]
    partial = changes.pull_back(before, after, excludes=sync.DEFAULT_EXCLUDES, deletions=False)
    assert partial.delete == []


def test_a_mode_change_comes_back():
    plan = changes.pull_back({"run.sh": stat_()}, {"run.sh": stat_(mode=0o755)}, excludes=())
    assert plan.upsert == ["run.sh"]


def test_deletions_are_collapsed_and_roots_are_unique():
    assert changes.collapse(["a/b", "a", "a/b/c", "ab", "c/d"]) == ["a", "ab", "c/d"]
    assert changes.sandbox_root(Path("/h/my repo")) == "/workspace/my_repo"
    assert changes.sandbox_root(Path("/h/repo"), {"repo"}) == "/workspace/repo-2"
    assert changes.sandbox_root(Path("/h/.hidden")) == "/workspace/hidden"
    assert changes.sandbox_root(Path("/")) == "/workspace/code"


def test_refused_paths_are_sent_again_next_round():
    synced = {
        "a": sync.Entry("file", digest="1"),
        "hook": sync.Entry("file", digest="2"),
        "d": sync.Entry("dir"),
    }
    after = changes.host_after(synced, {"b": sync.Entry("file", digest="3")}, ["d"], ["hook", "planted"])
    assert after["b"].digest == "3" and "d" not in after
    assert after["hook"] == changes.REFUSED and after["planted"] == changes.REFUSED
    host_now = {"a": synced["a"], "hook": synced["hook"], "b": after["b"]}
    resend = sync.diff(after, host_now)
    assert resend.upsert == ["hook"] and resend.delete == ["planted"]


# ---- tar up and down ------------------------------------------------------------------------------


def test_pack_never_follows_symlinks_and_carries_no_host_names(tmp_path):
    root = tmp_path / "code"
    (root / "d").mkdir(parents=True)
    (root / "d" / "f").write_bytes(b"\0binary" * 1000)
    os.chmod(root / "d" / "f", 0o755)
    (root / "out").symlink_to("/etc/passwd")
    manifest = sync.scan(root)
    data = b"".join(archive.pack(root, sorted(manifest), manifest, {".git/config": b"[core]\n"}))
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        members = {m.name: m for m in tar.getmembers()}
        assert members["out"].issym() and members["out"].linkname == "/etc/passwd"
        assert tar.extractfile("d/f").read() == b"\0binary" * 1000
        assert members["d/f"].mode == 0o755
        assert {m.uname for m in members.values()} == {""} and {m.uid for m in members.values()} == {0}
        assert tar.extractfile(".git/config").read() == b"[core]\n"


def test_pack_skips_a_file_swapped_for_a_symlink_after_the_scan(tmp_path):
    root = tmp_path / "code"
    root.mkdir()
    (root / "f").write_text("x")
    manifest = sync.scan(root)
    (root / "f").unlink()
    (root / "f").symlink_to("/etc/shadow")
    skipped: list = []
    data = b"".join(archive.pack(root, ["f"], manifest, None, skipped))
    assert [p for p, _ in skipped] == ["f"]
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        assert tar.getnames() == []


def _tar(*members: tuple[tarfile.TarInfo, bytes]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for info, data in members:
            info.size = len(data) if info.isreg() else 0
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return out.getvalue()


def _member(name, kind=tarfile.REGTYPE, linkname="", mode=0o644):
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, linkname, mode
    return info


def test_a_download_yields_only_what_was_asked_once_and_only_plain_kinds():
    data = _tar(
        (_member("a"), b"A"),
        (_member("a"), b"again"),
        (_member("extra"), b"not asked"),
        (_member("hard", tarfile.LNKTYPE, "a"), b""),
        (_member("dev", tarfile.CHRTYPE), b""),
        (_member("link", tarfile.SYMTYPE, "a"), b""),
        (_member("dir", tarfile.DIRTYPE, mode=0o755), b""),
    )
    download = archive.Download()
    download.write(data)
    got = [
        (i[0], i[1], i[2].read()) if len(i) == 3 else i
        for i in download.members(
            {
                "a": ("f", None),
                "hard": ("f", None),
                "dev": ("f", None),
                "link": ("l", None),
                "dir": ("d", None),
            }
        )
    ]
    download.close()
    applied = {item[0]: item[1] for item in got if len(item) == 3}
    refused = {item[0] for item in got if len(item) == 2}
    assert applied["a"].kind == "file" and applied["link"].target == "a" and applied["dir"].kind == "dir"
    assert refused == {"a", "extra", "hard", "dev"}  # the second "a" is refused


def test_a_broken_download_is_reported_not_raised():
    download = archive.Download()
    download.write(b"this is not a tar" * 100)
    got = list(download.members({"a": ("f", None)}))
    download.close()
    assert got and all(len(item) == 2 for item in got)


# ---- the executor's checks ----------------------------------------------------------------------


def _run(**kw):
    fields = {
        "session_id": "s",
        "sandbox_id": "sb",
        "inbox": "i",
        "stop": "s",
        "command": "true",
        "cwd": "/workspace",
    }
    return execution.Run(**{**fields, **kw})


@pytest.mark.parametrize(
    "kw",
    [
        {"command": "  "},
        {"command": "a\0b"},
        {"cwd": "relative"},
        {"env": {"A=B": "1"}},
        {"unset": ["1X"]},
        {"env": {"A": "x\0"}},
        {"timeout": 0},
        {"timeout": 10_000},
        {"list_root": "/etc"},
        {"prune": ["a/b"]},
    ],
)
def test_a_bad_run_is_refused_before_anything_runs(kw):
    with pytest.raises(errors.InvalidInput):
        streamed.validate(_run(**kw))


def test_uploads_refuse_paths_that_climb():
    put = execution.PutFiles(
        session_id="s", sandbox_id="sb", inbox="i", stop="s", root="/workspace/a", delete=["../x"]
    )
    with pytest.raises(errors.InvalidInput):
        streamed.validate(put)


def test_the_listing_prunes_only_directories_by_name():
    argv = streamed.listing_argv(["node_modules", ".venv"])
    assert argv[:4] == ["find", ".", "-mindepth", "1"]
    assert argv[4:15] == ["(", "-type", "d", "(", "-name", "node_modules", "-o", "-name", ".venv", ")", ")"]
    assert argv[-2:] == ["-printf", hostapi.LIST_FORMAT]
    assert streamed.run_argv(_run(unset=["A", "B"])) == ["env", "-u", "A", "-u", "B", "bash", "-c", "true"]


def test_a_partial_listing_is_merged_into_the_last_known_one():
    known = {"a": stat_(), "d": stat_("d"), "d/x": stat_(), "d/y": stat_(), "b": stat_()}
    merged = changes.merge_listing(
        known, ["a", "d", "new", "gone"], ["d"], {"a": stat_(size=5), "new": stat_()}
    )
    assert merged == {"a": stat_(size=5), "b": stat_(), "new": stat_()}


def test_an_upload_lists_all_of_the_tree_only_the_named_paths_or_nothing():
    base = {"session_id": "s", "sandbox_id": "sb", "inbox": "i", "stop": "s", "root": "/workspace/a"}
    assert streamed.put_listing_argv(execution.PutFiles(**base, listing=False)) == []
    assert streamed.put_listing_argv(execution.PutFiles(**base))[:2] == ["find", "."]
    named = streamed.put_listing_argv(execution.PutFiles(**base, list_paths=["x", "d/y"]))
    assert named[:5] == ["find", "x", "d/y", "-maxdepth", "0"] and "%p" in named[-1]
    with pytest.raises(errors.InvalidInput):
        streamed.validate(execution.PutFiles(**base, list_paths=["-delete"]))


def test_a_sparse_member_or_one_larger_than_its_listing_is_refused():
    sparse = _member("holes")
    sparse.type = tarfile.GNUTYPE_SPARSE
    data = _tar((_member("big"), b"x" * 100), (_member("ok"), b"fine"))
    download = archive.Download()
    download.write(data)
    got = {
        i[0]: (i[0], i[1], i[2].read()) if len(i) == 3 else i
        for i in download.members({"big": ("f", 10), "ok": ("f", 4)})
    }
    download.close()
    assert len(got["big"]) == 2 and "larger" in got["big"][1]
    assert got["ok"][2] == b"fine"


def test_the_sparse_bomb_is_refused(tmp_path):
    """A 10 KB tar that claims a huge sparse file (GNU sparse): refused without reading it."""
    holes = tmp_path / "holes"
    with holes.open("wb") as f:
        f.truncate(256 << 20)
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.GNU_FORMAT) as tar:
        info = tar.gettarinfo(holes, "holes")
        info.type = tarfile.GNUTYPE_SPARSE
        info.sparse = [(0, 0)]
        info.size = 256 << 20
        tar.addfile(info)
    download = archive.Download()
    download.write(out.getvalue()[:20_000])
    got = list(download.members({"holes": ("f", None)}))
    download.close()
    assert all(len(item) == 2 for item in got)


def test_a_download_beyond_its_cap_stops():
    download = archive.Download(limit=10)
    with pytest.raises(archive.TooLarge):
        download.write(b"x" * 11)
    download.close()


def test_only_history_goes_up_from_any_git_directory():
    entries = {
        p: sync.Entry("dir" if p.endswith((".git", "hooks", "modules", "refs")) else "file")
        for p in [
            ".git", ".git/config", ".git/HEAD", ".git/hooks", ".git/hooks/pre-push", ".git/info/exclude",
            ".git/modules", ".git/modules/lib/config", ".git/refs", "src/a.py",
            "vendor/dep/.git", "vendor/dep/.git/config", "vendor/dep/.git/index", "x/.GIT/config",
            "bad\nname",
        ]
    }  # fmt: skip
    sent, unsendable = changes.for_upload(entries)
    assert set(sent) == {
        ".git",
        ".git/HEAD",
        ".git/info/exclude",
        ".git/refs",
        "src/a.py",
        "vendor/dep/.git",
        "vendor/dep/.git/index",
    }
    assert unsendable == ["bad\nname"]
    assert changes.git_dirs(entries) == [".git", "vendor/dep/.git"]


def test_excluded_directories_never_come_back_in_another_case():
    after = {".VENV": stat_("d"), ".VENV/lib/zz.pth": stat_(), ".SBX/stack.json": stat_(), "ok": stat_()}
    plan = changes.pull_back({}, after, excludes=sync.DEFAULT_EXCLUDES)
    assert plan.upsert == ["ok"]


def test_names_that_cannot_travel_are_left_out_and_reported():
    after = {"x\ny": stat_(), "fine": stat_()}
    assert changes.pull_back({}, after, excludes=()).upsert == ["fine"]
    assert changes.not_text(after) == ["x\\ny"]


def test_git_objects_are_create_only_and_a_gitfile_stays(tmp_path):
    root = tmp_path / "code"
    obj = root / ".git" / "objects" / "ab"
    obj.mkdir(parents=True)
    (obj / ("c" * 38)).write_bytes(b"original")
    (root / "sub").mkdir()
    (root / "sub" / ".git").write_text("gitdir: ../.git/modules/sub\n")
    name = ".git/objects/ab/" + "c" * 38
    report = sync.apply(
        root,
        sync.Changes(upsert=[name, "sub/.git"], delete=[".git/objects/ab"]),
        {name: sync.Entry("file", mode=0o444), "sub/.git": sync.Entry("dir", mode=0o755)},
        lambda _: b"tampered",
    )
    assert (obj / ("c" * 38)).read_bytes() == b"original"
    assert (root / "sub" / ".git").is_file()
    assert {p for p, _ in report.refused} == {name, "sub/.git", ".git/objects/ab"}


def _git(*args, cwd, input=None):
    import subprocess

    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, input=input).stdout


def test_git_objects_come_back_only_when_their_names_are_their_hashes(tmp_path):
    """Loose objects are inflated and hashed; packs are indexed by the host's git (which
    hashes every object) and the sandbox's index files are never taken."""
    import zlib

    host = tmp_path / "host"
    host.mkdir()
    _git("init", "-q", cwd=host)
    sandbox = tmp_path / "sandbox"
    sandbox.mkdir()
    _git("init", "-q", cwd=sandbox)
    (sandbox / "g").write_text("good\n")
    oid = _git("hash-object", "-w", "g", cwd=sandbox).decode().strip()
    loose = (sandbox / ".git" / "objects" / oid[:2] / oid[2:]).read_bytes()
    forged_name = "ab" * 20
    entries = {}
    changes_ = sync.Changes()
    payload = {}

    def add(path, data):
        entries[path] = sync.Entry("file", mode=0o444)
        changes_.upsert.append(path)
        payload[path] = data

    add(f".git/objects/{oid[:2]}/{oid[2:]}", loose)
    add(f".git/objects/{forged_name[:2]}/{forged_name[2:]}", loose)  # right content, wrong name
    add(".git/objects/cd/" + "ef" * 19, zlib.compress(b"blob 999999999\0" + b"x" * 10))  # lies
    # A real pack of the sandbox's object, plus a sandbox-made index that could lie.
    pack_hash = (
        _git("pack-objects", "-q", str(tmp_path / "p"), cwd=sandbox, input=(oid + "\n").encode())
        .decode()
        .strip()
    )
    pack = (tmp_path / f"p-{pack_hash}.pack").read_bytes()
    add(f".git/objects/pack/pack-{pack_hash}.pack", pack)
    add(f".git/objects/pack/pack-{pack_hash}.idx", (tmp_path / f"p-{pack_hash}.idx").read_bytes())
    add(f".git/objects/pack/pack-{'0' * 40}.pack", pack)  # a pack under another name
    report = sync.apply(host, changes_, entries, lambda p: payload[p])
    refused = {p for p, _ in report.refused}
    assert f".git/objects/{oid[:2]}/{oid[2:]}" in report.written
    assert f".git/objects/pack/pack-{pack_hash}.pack" in report.written
    assert refused == {
        f".git/objects/{forged_name[:2]}/{forged_name[2:]}",
        ".git/objects/cd/" + "ef" * 19,
        f".git/objects/pack/pack-{pack_hash}.idx",
        f".git/objects/pack/pack-{'0' * 40}.pack",
    }
    assert (host / ".git" / "objects" / "pack" / f"pack-{pack_hash}.idx").exists()  # made by the host
    assert _git("cat-file", "-p", oid, cwd=host) == b"good\n"
    assert not list((host / ".git" / "objects").rglob(".*sbx-*"))  # no temporary left


def test_a_member_of_another_kind_than_its_listing_is_refused():
    """A path listed as a directory or link has no size cap: it may not arrive as a file."""
    download = archive.Download()
    download.write(_tar((_member("d"), b"x" * 1000), (_member("l"), b"y")))
    got = list(download.members({"d": ("d", None), "l": ("l", None)}))
    download.close()
    assert [len(item) for item in got] == [2, 2] and "kind" in got[0][1]


@pytest.mark.parametrize(
    ("path", "refused"),
    [
        ("/", True), ("/home/ann", True), ("/home", True), ("/home/ann/.config/nvim", True),
        ("/home/ann/.ssh", True), ("/etc", True), ("/etc/nginx", True), ("/usr/local/src/x", True),
        ("/home/ann/code/repo", False), ("/var/lib/jenkins/workspace/job", False), ("/tmp/x", False),
        ("/home/ann/code/.hidden-project", False),
    ],
)  # fmt: skip
def test_what_cannot_be_a_code_dir(path, refused):
    from sbx_client.sandbox import not_a_code_dir

    assert (not_a_code_dir(Path(path), Path("/home/ann")) is not None) is refused


def test_a_git_entry_is_never_deleted_from_the_host(tmp_path):
    root = tmp_path / "code"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / ".git").write_text("gitdir: ../.git/modules/sub\n")
    report = sync.apply(root, sync.Changes(delete=["sub/.git"]), {}, lambda _: b"")
    assert (root / "sub" / ".git").is_file() and [p for p, _ in report.refused] == ["sub/.git"]
