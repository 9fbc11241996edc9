"""Running routed commands on the host (sbx/client/hostrun.py) with real git: argv lists,
no shell, hardened git (no hooks, no fsmonitor, explicit repository, no bare-repo
discovery), ``&&`` and pipes like bash."""

from __future__ import annotations

import subprocess

import pytest

from sbx.client import hostrun, route

IDENT = ["-c", "user.name=t", "-c", "user.email=t@e"]


def git(*args: str, cwd) -> str:
    return subprocess.run(["git", *IDENT, *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


@pytest.fixture
def code(tmp_path):
    code = tmp_path / "code"
    repo = code / "repo"
    repo.mkdir(parents=True)
    git("init", "-q", "-b", "main", cwd=repo)
    (repo / "f").write_text("x\n")
    git("add", "f", cwd=repo)
    git("commit", "-qm", "one", cwd=repo)
    git("init", "-q", "--bare", str(code / "remote.git"), cwd=code)
    return code


def run(code, command: str, cwd: str = "repo") -> tuple[int, str]:
    decided = route.route(command, [code], code / cwd)
    assert decided.where == "host", decided.why
    out: list[bytes] = []
    status = hostrun.run(decided.plan, write=out.append)
    return status, b"".join(out).decode()


def test_a_push_runs_without_the_hooks_a_sandbox_could_have_planted(code):
    marker = code.parent / "hook-ran"
    hook = code / "repo" / ".git" / "hooks" / "pre-push"
    hook.write_text(f"#!/bin/sh\ntouch {marker}\n")
    hook.chmod(0o755)
    status, out = run(code, "git push ../remote.git HEAD:refs/heads/main")
    assert status == 0, out
    assert (
        git("rev-parse", "main", cwd=code / "remote.git").strip()
        == git("rev-parse", "HEAD", cwd=code / "repo").strip()
    )
    assert not marker.exists(), "the planted hook never runs on the host"


def test_pipes_and_and_behave_like_bash(code):
    run(code, "git push ../remote.git HEAD:refs/heads/main")
    status, out = run(code, "git ls-remote ../remote.git | grep -c refs/heads")
    assert (status, out) == (0, "1\n")
    status, out = run(code, "git fetch no-such-remote 2>/dev/null && echo after")
    assert status != 0 and "after" not in out


def test_a_gitfile_pointing_elsewhere_is_refused(code, tmp_path):
    other = code / "other"
    other.mkdir()
    (other / ".git").write_text(f"gitdir: {tmp_path}/elsewhere\n")
    decided = route.route("git fetch", [code], other)
    with pytest.raises(hostrun.HostRunError, match="not a directory"):
        hostrun.run(decided.plan, write=lambda _: None)


def test_an_embedded_bare_repository_is_not_picked_up(code):
    """A bare repository planted in the tree (say, a directory with HEAD, objects and
    refs) is never what host-side git works on: the repository is named explicitly."""
    planted = code / "repo" / "sub"
    git("init", "-q", "--bare", str(planted), cwd=code)
    status, out = run(code, "git push ../../remote.git HEAD:refs/heads/x", cwd="repo/sub")
    assert status == 0, out
    assert (
        git("rev-parse", "x", cwd=code / "remote.git").strip()
        == git("rev-parse", "HEAD", cwd=code / "repo").strip()
    )
