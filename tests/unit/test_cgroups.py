"""The cgroup driver's removal, on a directory tree standing in for /sys/fs/cgroup."""

from __future__ import annotations

import pytest

from shared.contract import errors
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
