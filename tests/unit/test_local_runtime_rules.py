"""The local runtime's pure rules, apart from its I/O: a sandbox's status from its
records, which specs it refuses, what a fork may not change, which top-level directories
a writable sandbox keeps on its disk, and the proxy environment."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from sbx_api import errors
from shared.runtime import api
from shared.runtime.local import bwrap, egresslinks, images, plans, runtime, sandboxdirs, snapshots


@pytest.mark.parametrize(
    ("running", "frozen", "started", "status"),
    [
        (True, False, False, "running"),
        (True, True, False, "paused"),
        (True, True, True, "paused"),
        (False, False, True, "stopped"),
        (False, False, False, "created"),
    ],
)
def test_status_of(running: bool, frozen: bool, started: bool, status: str) -> None:
    assert sandboxdirs.status_of(running=running, frozen=frozen, started=started) == status


def test_cgroup_name_is_the_directory_token_and_never_the_raw_id() -> None:
    name = sandboxdirs.cgroup_name("../a b*")
    assert name.startswith("sbx-") and "/" not in name and " " not in name and "*" not in name
    assert name == sandboxdirs.cgroup_name("../a b*") != sandboxdirs.cgroup_name("other")


@pytest.mark.parametrize(
    ("spec", "kind"),
    [
        (api.SandboxSpec(sandbox_id="s"), None),
        (api.SandboxSpec(sandbox_id="s", isolation="strong"), errors.NotBuiltYet),
        (api.SandboxSpec(sandbox_id="s", limits=api.Limits(memory_bytes=1024**2)), errors.InvalidInput),
        (api.SandboxSpec(sandbox_id="s", limits=api.Limits(pids=4)), errors.InvalidInput),
        (api.SandboxSpec(sandbox_id="s", limits=api.Limits(disk_bytes=1024**2)), errors.InvalidInput),
        (
            api.SandboxSpec(sandbox_id="s", limits=api.Limits(disk_bytes=1024**3, disk_inodes=10)),
            errors.InvalidInput,
        ),
    ],
)
def test_spec_problem(spec: api.SandboxSpec, kind: type[errors.SandboxError] | None) -> None:
    problem = runtime.spec_problem(spec)
    assert (type(problem) if problem is not None else None) is kind


def _snapshot(**changes: object) -> api.SnapshotInfo:
    fields: dict[str, object] = dict(
        snapshot_id="snap", sandbox_id="s", digest="d", layers=("l",), parent=None, size=1,
        total_size=1, files=1, image="default", image_digest=None, run_as_root=True,
        writable_root=True, created_at=datetime.now(UTC), frozen_seconds=0.0,
    )  # fmt: skip
    return api.SnapshotInfo(**(fields | changes))  # type: ignore[arg-type]


def test_a_fork_may_not_change_its_snapshots_image_or_user_or_root() -> None:
    spec = api.SandboxSpec(sandbox_id="f", snapshot="snap")
    assert snapshots.fork_differences(spec, _snapshot()) == []
    differs = snapshots.fork_differences(spec, _snapshot(image="python:3.12", run_as_root=False))
    assert differs == ["image 'python:3.12'", "run_as_root False"]


def test_writable_dirs_only_for_a_writable_root_without_a_root_layer() -> None:
    rw = Path("/rw")
    usr = images.Image(
        name="default", layers=(bwrap.Layer(Path("/usr"), "/usr"),), symlinks=(("usr/bin", "/bin"),)
    )
    kept = plans.writable_dirs(usr, rw, True)
    assert kept == tuple((rw / "dirs" / top.strip("/"), top) for top in plans.TOP_DIRS)
    assert plans.writable_dirs(usr, rw, False) == ()
    rooted = images.Image(name="img", layers=(bwrap.Layer(Path("/img"), "/"),))
    assert plans.writable_dirs(rooted, rw, True) == ()
    with_home = images.Image(name="img", layers=(bwrap.Layer(Path("/h"), "/home"),))
    assert "/home" not in {dest for _, dest in plans.writable_dirs(with_home, rw, True)}


def test_proxy_env_names_the_proxy_and_the_bundle_for_every_tool() -> None:
    env = egresslinks.proxy_env("http://10.0.0.1:3128")
    assert env["HTTPS_PROXY"] == env["http_proxy"] == "http://10.0.0.1:3128"
    bundle = f"{egresslinks.CA_DIR}/ca-bundle.pem"
    for name in ("SSL_CERT_FILE", "GIT_SSL_CAINFO", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "PIP_CERT"):
        assert env[name] == bundle
    assert env["NODE_EXTRA_CA_CERTS"] == f"{egresslinks.CA_DIR}/proxy-ca.pem"
    assert "127.0.0.1" in env["NO_PROXY"].split(",")
