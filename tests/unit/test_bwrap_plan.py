"""The bubblewrap command line is a pure function of a plan: each isolation decision,
field by field (shared/runtime/local/bwrap.py)."""

from __future__ import annotations

from pathlib import Path

from shared.runtime.local import bwrap


def plan(**kw) -> bwrap.Plan:
    base = Path("/state/sandboxes/t")
    fields = dict(
        bwrap="/bin/bwrap",
        layers=(bwrap.Layer(Path("/usr"), "/usr"),),
        symlinks=(),
        dirs=("/root",),
        upper=base / "upper",
        workspace=base / "workspace",
        control=base / "control",
        hold=base / "hold",
        run_as_root=True,
        writable_root=True,
    )
    fields.update(kw)
    return bwrap.Plan(**fields)


def pairs(args: list[str], flag: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a == flag]


def test_the_runtimes_user_namespace_replaces_bwraps_own():
    own = bwrap.argv(plan(), ["true"])
    assert pairs(own, "--userns") == [str(bwrap.USERNS_FD)]
    assert "--unshare-user" not in own and "--unshare-all" not in own
    unshared = {"--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup"}
    assert unshared <= set(own)


def test_capabilities_are_dropped_then_a_few_kept_for_root_only():
    root = bwrap.argv(plan(), ["true"])
    assert pairs(root, "--cap-drop") == ["ALL"]
    assert set(pairs(root, "--cap-add")) == set(bwrap.ROOT_CAPS)
    assert not {"CAP_SYS_ADMIN", "CAP_NET_ADMIN", "CAP_NET_RAW", "CAP_SYS_PTRACE"} & set(bwrap.ROOT_CAPS)
    user = bwrap.argv(plan(run_as_root=False), ["true"])
    assert pairs(user, "--cap-drop") == ["ALL"] and pairs(user, "--cap-add") == []
    assert pairs(user, "--uid") == [str(bwrap.SANDBOX_UID)]


def test_the_filter_host_kernel_settings_and_scratch_spaces():
    args = bwrap.argv(plan(proc_read_only=("/proc/sys",), proc_masked=("/proc/kcore",), tmp_bytes=123), ["x"])
    assert pairs(args, "--seccomp") == [str(bwrap.SECCOMP_FD)]
    binds = [(args[i + 1], args[i + 2]) for i, a in enumerate(args) if a == "--ro-bind"]
    assert ("/proc/sys", "/proc/sys") in binds and ("/dev/null", "/proc/kcore") in binds
    assert args.index("--proc") < args.index("/proc/sys")  # covers go over the new /proc
    assert pairs(args, "--size")[:2] == ["123", str(bwrap.OUTPUT_BYTES)]
    assert pairs(args, "--tmpfs") == ["/tmp", bwrap.OUTPUT_DIR]
    assert "--clearenv" in args and args[-2:] == ["--", "x"]


def test_writable_directories_come_from_the_sandboxs_disk():
    source = Path("/state/sandboxes/t/rw/dirs/var")
    args = bwrap.argv(plan(writable=((source, "/var"),)), ["true"])
    binds = [(args[i + 1], args[i + 2]) for i, a in enumerate(args) if a == "--bind"]
    assert (str(source), "/var") in binds


def test_tmp_is_half_the_memory_at_most_and_open_files_stay_under_the_file_table():
    assert bwrap.tmp_bytes(256 * 1024**2) == 128 * 1024**2
    assert bwrap.tmp_bytes(64 * 1024**3) == bwrap.TMP_BYTES
    assert bwrap.nofile(512, 2_466_126) == bwrap.NOFILE_MIN
    assert bwrap.nofile(8, 2**40) == bwrap.NOFILE_MAX
