"""The cgroup driver's removal, on a directory tree standing in for /sys/fs/cgroup."""

from __future__ import annotations

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
