"""What reaches the sandbox from the host (clients/python/sbx_client/forward.py): variables only by name,
git config through exact key allowlists, read with git's own parser."""

from __future__ import annotations

import subprocess

import pytest

from sbx_client import forward


def test_no_variable_goes_in_unless_named_and_named_ones_missing_are_unset():
    host = {"SANDBOX_API_KEY": "secret", "GITHUB_TOKEN": "ghp_x", "LANG": "C.UTF-8", "CI": "1"}
    assert forward.forwarded_env(host, "") == ({}, [])
    present, unset = forward.forwarded_env(host, "LANG, CI MISSING")
    assert present == {"LANG": "C.UTF-8", "CI": "1"} and unset == ["MISSING"]
    with pytest.raises(ValueError, match="not variable names"):
        forward.forwarded_env(host, "LANG,$(evil)")


HOST_CONFIG = """
[user]
\tname = Ann Example
\temail = ann@example.com
[alias]
\tco = !sh -c 'evil'
[core]
\tsshCommand = ssh -i ~/.ssh/key
\taskPass = /usr/bin/evil
\thooksPath = /tmp/hooks
\tautocrlf = input
[credential]
\thelper = store
[http]
\textraHeader = Authorization: Bearer secret
[url "https://ann:tok@github.com/"]
\tinsteadOf = https://github.com/
[include]
\tpath = /etc/evil.gitconfig
[init]
\tdefaultBranch = main
"""

REPO_CONFIG = """
[core]
\trepositoryformatversion = 0
\tbare = false
\tfsmonitor = /tmp/evil-monitor
[remote "origin"]
\turl = https://github.com/org/repo.git
\tfetch = +refs/heads/*:refs/remotes/origin/*
[remote "leaky"]
\turl = https://ann:tok@github.com/org/repo.git
[remote "tokenuser"]
\turl = https://ghp_secret@github.com/org/repo.git
[remote "query"]
\turl = https://gitlab.example/org/repo.git?private_token=secret
[remote "ssh"]
\turl = git@github.com:org/repo.git
[branch "Main"]
\tremote = origin
\tmerge = refs/heads/main
[filter "lfs"]
\tclean = evil %f
[user]
\temail = ann@work.example
"""


def config(tmp_path, text: str):
    path = tmp_path / "config"
    path.write_text(text)
    return forward.read_config(path)


def test_the_host_config_gives_identity_and_everyday_settings_only(tmp_path):
    kept = dict(forward.allowed(config(tmp_path, HOST_CONFIG), repository=False))
    assert kept == {
        "user.name": "Ann Example",
        "user.email": "ann@example.com",
        "core.autocrlf": "input",
        "init.defaultbranch": "main",
    }


def test_a_repository_config_adds_what_git_needs_there_and_nothing_that_runs(tmp_path):
    kept = forward.allowed(config(tmp_path, REPO_CONFIG), repository=True)
    keys = [k for k, _ in kept]
    assert keys == [
        "core.repositoryformatversion", "core.bare", "remote.origin.url", "remote.origin.fetch",
        "remote.ssh.url", "branch.Main.remote", "branch.Main.merge", "user.email",
    ]  # fmt: skip
    assert all("tok@" not in v and "secret" not in v for _, v in kept), "URLs with credentials are dropped"


def test_an_unparsable_file_gives_an_empty_config_and_includes_are_not_followed(tmp_path):
    assert forward.allowed(config(tmp_path, "[user\n\tname = x\n"), repository=False) == []
    other = tmp_path / "other"
    other.write_text("[user]\n\tname = from an include\n")
    pairs = config(tmp_path, f"[include]\n\tpath = {other}\n")
    assert forward.allowed(pairs, repository=False) == []


def test_the_rendered_file_reads_back_the_same(tmp_path):
    pairs = forward.allowed(config(tmp_path, REPO_CONFIG), repository=True)
    out = tmp_path / "rendered"
    out.write_text(forward.render(pairs))
    assert forward.read_config(out) == pairs
    listed = subprocess.run(["git", "config", "--file", str(out), "--list"], capture_output=True, text=True)
    assert "fsmonitor" not in listed.stdout and "filter" not in listed.stdout
