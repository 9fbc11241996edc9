"""git clone and push of a smart-HTTP repository through the real proxy, with the
credential injected in flight: git itself has no credential and never prompts. A large
clone and a large push stream through the proxy (its peak memory stays far below the
pack's size)."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.proxy import harness

pytestmark = [
    pytest.mark.needs_root("the proxy runs in its own mount namespace (root)"),
    pytest.mark.slow,
]
TOKEN = "ghs_" + "gitTokenForTests" * 3
BIG = 48 * 1024 * 1024


def git(*args: str, cwd=None, env=None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("git")
    pki = harness.PKI(tmp / "pki")
    root = tmp / "srv"
    (root / "org").mkdir(parents=True)
    seed = tmp / "seed"
    base = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com",
            "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com"}  # fmt: skip
    assert git("init", "-q", "-b", "main", str(seed), env=base).returncode == 0
    (seed / "big.bin").write_bytes(os.urandom(BIG))
    (seed / "README").write_text("hello\n")
    git("add", ".", cwd=seed, env=base)
    assert git("commit", "-qm", "seed", cwd=seed, env=base).returncode == 0
    assert git("clone", "-q", "--bare", str(seed), str(root / "org" / "repo.git"), env=base).returncode == 0
    git("config", "http.receivepack", "true", cwd=root / "org" / "repo.git")
    upstream = harness.Upstream(pki, harness.GitSmartHTTP)
    upstream.server.token, upstream.server.root = TOKEN, root
    config = f"""
[destinations]
allow = ["127.0.0.1/32"]

[[rules]]
name = "github-git"
kind = "basic"
hosts = ["github.com:{upstream.port}"]
username = "x-access-token"
password_env = "SBX_TEST_GIT_TOKEN"
"""
    proxy = harness.Proxy(
        tmp / "proxy", config, pki.ca_cert, {"github.com": "127.0.0.1"}, env={"SBX_TEST_GIT_TOKEN": TOKEN}
    )
    env = {
        **base,
        "HOME": str(tmp / "home"),
        "GIT_TERMINAL_PROMPT": "0",
        "GIT_SSL_CAINFO": str(proxy.ca_cert),
        "HTTPS_PROXY": f"http://127.0.0.1:{proxy.port}",
        "GIT_CONFIG_NOSYSTEM": "1",
    }
    (tmp / "home").mkdir()
    yield tmp, upstream, proxy, env, root
    proxy.close()
    upstream.close()
    assert TOKEN not in proxy.output()


def test_clone_and_push_with_the_injected_credential_and_a_large_clone_streams(world):
    tmp, upstream, proxy, env, root = world
    url = f"https://github.com:{upstream.port}/org/repo.git"
    before = harness.peak_rss_kib(proxy.proc.pid)
    cloned = git("clone", "-q", url, str(tmp / "work"), env=env)
    assert cloned.returncode == 0, cloned.stderr
    assert (tmp / "work" / "big.bin").stat().st_size == BIG
    grown = harness.peak_rss_kib(proxy.proc.pid) - before
    assert grown < BIG // 1024 // 2, f"the proxy's peak memory grew by {grown} KiB for a {BIG >> 20} MiB pack"
    assert all("Authorization" not in s["headers"] or s["headers"]["Authorization"].startswith("Basic ")
               for s in upstream.seen)  # fmt: skip
    (tmp / "work" / "change.txt").write_text("from the sandbox\n")
    (tmp / "work" / "big2.bin").write_bytes(os.urandom(BIG))  # a large push streams too
    git("add", ".", cwd=tmp / "work", env=env)
    assert git("commit", "-qm", "change", cwd=tmp / "work", env=env).returncode == 0
    before = harness.peak_rss_kib(proxy.proc.pid)
    pushed = git("push", "-q", "origin", "main", cwd=tmp / "work", env=env)
    assert pushed.returncode == 0, pushed.stderr
    grown = harness.peak_rss_kib(proxy.proc.pid) - before
    assert grown < BIG // 1024 // 2, f"the proxy's peak memory grew by {grown} KiB for a {BIG >> 20} MiB push"
    log = git("log", "--format=%s", "main", cwd=root / "org" / "repo.git")
    assert log.stdout.split() == ["change", "seed"]
    remote_url = git("remote", "get-url", "origin", cwd=tmp / "work").stdout.strip()
    assert remote_url == url and TOKEN not in (tmp / "work" / ".git" / "config").read_text()


def test_without_the_proxy_git_fails_without_prompting(world):
    tmp, upstream, _, env, _ = world
    direct = {k: v for k, v in env.items() if k != "HTTPS_PROXY"} | {"GIT_SSL_CAINFO": upstream_ca(tmp)}
    url = f"https://127.0.0.1:{upstream.port}/org/repo.git"
    failed = git("clone", "-q", url, str(tmp / "nope"), env=direct)
    assert failed.returncode != 0 and "terminal prompts disabled" in failed.stderr


def upstream_ca(tmp) -> str:
    return str(tmp / "pki" / "test-ca.pem")
