"""Running routed commands on the host (clients/python/sbx_client/hostrun.py) with real git against a
real smart-HTTP remote (git's own http-backend) that wants the host's credential: argv
lists, no shell, hardened git (no hooks, no local transport, no bare-repo discovery, an
explicit repository found no higher than the code dir), ``&&`` and pipes like bash."""

from __future__ import annotations

import base64
import subprocess

import pytest

from sbx_client import hostrun, route
from tests.proxy import harness

IDENT = ["-c", "user.name=t", "-c", "user.email=t@e"]
TOKEN = "host-only-token"


def git(*args: str, cwd) -> str:
    return subprocess.run(["git", *IDENT, *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


@pytest.fixture
def remote(tmp_path):
    with harness.git_remote(tmp_path, TOKEN) as served:
        yield served


@pytest.fixture
def code(tmp_path, remote, monkeypatch):
    """A code dir with a repository whose origin is the smart-HTTP remote; the host's git
    config (here: the environment) carries the credential."""
    server, _ = remote
    header = "Authorization: Basic " + base64.b64encode(f"x-access-token:{TOKEN}".encode()).decode()
    monkeypatch.setenv("GIT_CONFIG_COUNT", "1")
    monkeypatch.setenv("GIT_CONFIG_KEY_0", "http.extraHeader")
    monkeypatch.setenv("GIT_CONFIG_VALUE_0", header)
    code = tmp_path / "code"
    repo = code / "repo"
    repo.mkdir(parents=True)
    git("init", "-q", "-b", "main", cwd=repo)
    (repo / "f").write_text("x\n")
    git("add", "f", cwd=repo)
    git("commit", "-qm", "one", cwd=repo)
    git("remote", "add", "origin", f"http://127.0.0.1:{server.server_address[1]}/org/remote.git", cwd=repo)
    return code


def run(code, command: str, cwd: str = "repo") -> tuple[int, str]:
    decided = route.route(command, [code], code / cwd)
    assert decided.where == "host", decided.why
    out: list[bytes] = []
    status = hostrun.run(decided.plan, write=out.append)
    return status, b"".join(out).decode()


def test_a_push_uses_the_hosts_credential_and_never_the_hooks_a_sandbox_planted(code, remote):
    _, bare = remote
    marker = code.parent / "hook-ran"
    hook = code / "repo" / ".git" / "hooks" / "pre-push"
    hook.write_text(f"#!/bin/sh\ntouch {marker}\n")
    hook.chmod(0o755)
    status, out = run(code, "git push origin HEAD:refs/heads/main")
    assert status == 0, out
    assert git("rev-parse", "main", cwd=bare).strip() == git("rev-parse", "HEAD", cwd=code / "repo").strip()
    assert not marker.exists(), "the planted hook never runs on the host"


def test_pipes_and_and_behave_like_bash(code):
    run(code, "git push origin HEAD:refs/heads/main")
    status, out = run(code, "git ls-remote origin | grep -c refs/heads")
    assert (status, out) == (0, "1\n")
    status, out = run(code, "git fetch origin refs/heads/nope 2>/dev/null && echo after")
    assert status != 0 and "after" not in out


def test_a_remote_name_the_repository_does_not_have_is_refused(code):
    """A bare word that is not a remote would be a path to git: a repository the sandbox
    planted in the tree, whose hooks the local transport would run."""
    planted = code / "repo" / "evil"
    git("init", "-q", "--bare", str(planted), cwd=code)
    decided = route.route("git push evil HEAD", [code], code / "repo")
    with pytest.raises(hostrun.HostRunError, match="not a remote"):
        hostrun.run(decided.plan, write=lambda _: None)


def test_a_gitfile_alternates_or_a_repository_above_the_code_dir_are_refused(code, tmp_path):
    other = code / "other"
    other.mkdir()
    (other / ".git").write_text(f"gitdir: {tmp_path}/elsewhere\n")
    decided = route.route("git fetch origin", [code], other)
    with pytest.raises(hostrun.HostRunError, match="not a directory"):
        hostrun.run(decided.plan, write=lambda _: None)
    # The code dir is a sub-directory of a repository: that repository is never used.
    inner = code / "repo" / "sub"
    inner.mkdir()
    decided = route.route("git fetch origin", [inner], inner)
    with pytest.raises(hostrun.HostRunError, match="within the code dir"):
        hostrun.run(decided.plan, write=lambda _: None)
    (code / "repo" / ".git" / "objects" / "info" / "alternates").write_text("/elsewhere/objects\n")
    decided = route.route("git fetch origin", [code], code / "repo")
    with pytest.raises(hostrun.HostRunError, match="alternates"):
        hostrun.run(decided.plan, write=lambda _: None)


def test_an_embedded_bare_repository_is_not_picked_up(code, remote):
    """A bare repository planted in the tree is never what host-side git works on: the
    repository is named explicitly."""
    _, bare = remote
    planted = code / "repo" / "sub"
    git("init", "-q", "--bare", str(planted), cwd=code)
    status, out = run(code, "git push origin HEAD:refs/heads/x", cwd="repo/sub")
    assert status == 0, out
    assert git("rev-parse", "x", cwd=bare).strip() == git("rev-parse", "HEAD", cwd=code / "repo").strip()


def test_filters_get_no_host_secrets(code, monkeypatch):
    monkeypatch.setenv("SANDBOX_API_KEY", "host-secret-key")
    status, out = run(code, "git ls-remote origin 2>&1 | grep -c host-secret-key")
    assert out.strip() == "0"


def test_a_host_command_is_bounded_in_time_and_output(code):
    run(code, "git push origin HEAD:refs/heads/main")
    decided = route.route("git ls-remote origin | sort -r", [code], code / "repo")
    out: list[bytes] = []
    assert hostrun.run(decided.plan, write=out.append, limit=10) == 0
    assert b"output cut" in b"".join(out)
    silent = route.route("git fetch git://10.255.255.1/never.git", [code], code / "repo")
    out.clear()
    assert hostrun.run(silent.plan, write=out.append, timeout=0.5) == 124
    assert b"timed out on the host" in b"".join(out)
