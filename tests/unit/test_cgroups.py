"""The cgroup driver's removal, on a directory tree standing in for /sys/fs/cgroup."""

from __future__ import annotations

import pytest

from sbx_api import errors
from shared.runtime.local import cgroups


def test_removing_a_group_that_is_gone_does_not_wait(tmp_path, monkeypatch):
    """A stopped sandbox's cgroup is already removed: deleting the sandbox must not retry
    (it used to wait 1 s per controller, 3 s per deleted sandbox)."""
    slept: list[float] = []
    monkeypatch.setattr(cgroups.time, "sleep", slept.append)
    for version in (1, 2):
        cgroups.Cgroups(version, tmp_path).remove("sbx-gone")
    assert slept == []


def test_an_empty_group_is_removed_in_every_controller(tmp_path):
    driver = cgroups.Cgroups(1, tmp_path)
    for d in driver.dirs("sbx-empty"):
        d.mkdir(parents=True)
    driver.remove("sbx-empty")
    assert not any(d.exists() for d in driver.dirs("sbx-empty"))


def test_a_freeze_stuck_on_a_vfork_parent_is_thawed_for_a_moment_and_tried_again(tmp_path, monkeypatch):
    """v1 stays FREEZING for ever when a vfork parent waits for a child frozen before its
    exec; the driver thaws for a moment (the child execs) and freezes again."""
    (tmp_path / "freezer").mkdir()
    (tmp_path / "freezer" / "cgroup.procs").write_text("")
    driver = cgroups.Cgroups(1, tmp_path)
    assert driver.can_freeze
    for d in driver.dirs("sbx-stuck"):
        d.mkdir(parents=True)
    writes: list[str] = []
    real_write = cgroups._write

    def record(path, value):
        if path.name == "freezer.state":
            writes.append(value)
        real_write(path, value)

    monkeypatch.setattr(cgroups, "_write", record)
    monkeypatch.setattr(cgroups.time, "sleep", lambda _: None)
    clock = iter(range(1000))
    monkeypatch.setattr(cgroups.time, "monotonic", lambda: next(clock) * 0.01)
    # Settles only once it was thawed and frozen again (the vfork child got to exec).
    monkeypatch.setattr(cgroups.Cgroups, "_settled", lambda self, name: writes[-2:] == ["THAWED", "FROZEN"])
    driver.freeze("sbx-stuck")
    assert writes == ["FROZEN", "THAWED", "FROZEN"]
    assert driver.frozen("sbx-stuck")
    driver.thaw("sbx-stuck")
    assert not driver.frozen("sbx-stuck")


def test_a_freeze_that_never_settles_is_thawed_and_refused(tmp_path, monkeypatch):
    (tmp_path / "freezer").mkdir()
    (tmp_path / "freezer" / "cgroup.procs").write_text("")
    driver = cgroups.Cgroups(1, tmp_path)
    for d in driver.dirs("sbx-never"):
        d.mkdir(parents=True)
    monkeypatch.setattr(cgroups.time, "sleep", lambda _: None)
    clock = iter(range(100_000))
    monkeypatch.setattr(cgroups.time, "monotonic", lambda: next(clock) * 0.01)
    monkeypatch.setattr(cgroups.Cgroups, "_settled", lambda self, name: False)
    with pytest.raises(errors.InfrastructureError, match="did not freeze"):
        driver.freeze("sbx-never")
    assert not driver.frozen("sbx-never")  # thawed again: never left half frozen


HYBRID = """\
25 1 0:24 / /sys/fs/cgroup rw,nosuid,nodev,noexec shared:9 - tmpfs tmpfs rw,mode=755
36 25 0:30 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:10 - cgroup2 cgroup2 rw,nsdelegate
37 25 0:31 / /sys/fs/cgroup/memory rw,relatime shared:11 - cgroup cgroup rw,memory
"""
FEATURES = "nsdelegate\nfavordynmods\nmemory_localevents\n"


def test_favordynmods_is_turned_on_with_the_mounts_other_options_kept() -> None:
    argv, about = cgroups.dynmods_remount(HYBRID, FEATURES)
    assert argv == [
        "mount", "-t", "cgroup2", "-o", "remount,rw,nosuid,nodev,noexec,relatime,nsdelegate,favordynmods",
        "cgroup2", "/sys/fs/cgroup/unified",
    ]  # fmt: skip
    assert "turned on at /sys/fs/cgroup/unified" in about
    on = HYBRID.replace("rw,nsdelegate", "rw,nsdelegate,favordynmods")
    assert cgroups.dynmods_remount(on, FEATURES) == (None, "favordynmods on already")
    argv, about = cgroups.dynmods_remount(HYBRID, "nsdelegate\n")
    assert argv is None and "no favordynmods" in about
    v1_only = "\n".join(line for line in HYBRID.splitlines() if "cgroup2" not in line)
    argv, about = cgroups.dynmods_remount(v1_only, FEATURES)
    assert argv is None and "no cgroup2 mount" in about


def test_favor_dynamic_moves_says_why_it_did_nothing(tmp_path) -> None:
    (tmp_path / "mountinfo").write_text(HYBRID.replace("rw,nsdelegate", "rw,favordynmods"))
    (tmp_path / "features").write_text(FEATURES)
    assert (
        cgroups.favor_dynamic_moves(tmp_path / "mountinfo", tmp_path / "features")
        == "favordynmods on already"
    )
    assert "no favordynmods" in cgroups.favor_dynamic_moves(tmp_path / "mountinfo", tmp_path / "nope")
    assert "not tuned" in cgroups.favor_dynamic_moves(tmp_path / "missing", tmp_path / "features")
