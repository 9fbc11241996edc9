"""Host routing against real bash: random commands built from harmless and hostile pieces
(a fixed seed, so a failure reproduces);
whenever the router says "host", bash runs the text in a temp code dir (with a stand-in
``git`` that only prints its arguments) and nothing outside the code dir may change."""

from __future__ import annotations

import os
import random
import subprocess
from pathlib import Path

import pytest

from sbx_client import route

PIECES = [
    "git", "git", "git", "push", "fetch", "pull", "clone", "ls-remote", "status", "origin", "HEAD",
    "main", "-u", "--force", "--depth", "1", "-c", "x=y", "--upload-pack=touch ../pwned", "-C", "..",
    "cd", "cd", "sub", "..", "../..", "/tmp", "&&", "&&", "|", "|", ";", "&", "||", ">", "<", ">>",
    ">/dev/null", "2>/dev/null", "2>&1", "out.txt", "../pwned", "$(touch ../pwned)", "`touch ../pwned`",
    "$HOME", "${HOME}", "~", "~/pwned", "*", "?", "[a]", "echo", "printf", "tee", "grep", "-c", "-v",
    "sort", "-o", "head", "-n", "tail", "jq", ".", "cut", "-d", ":", "-f2", "tr", "a", "b", "wc",
    "-l", "xargs", "touch", "rm", "-rf", "GIT_TRACE=1", "HOME=..", "GIT_DIR=..", "{", "}", "(", ")",
    "<<EOF", "'a b'", '"a b"', "'../pwned'", '"$(touch ../pwned)"', "file://../pwned", "ext::sh",
    "x", "-", "--", "!", "#", "\\", "'", '"',
]  # fmt: skip


@pytest.fixture(scope="module")
def sandbox_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    code = root / "code"
    (code / "repo" / "sub").mkdir(parents=True)
    (root / "home").mkdir()
    bin_dir = root / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "git"
    fake.write_text('#!/bin/sh\nprintf "git %s\\n" "$*"\n')
    fake.chmod(0o755)
    return root


def state_outside(root: Path) -> dict[str, tuple[int, int]]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        if Path(dirpath) == root / "code":
            dirnames[:] = []
            continue
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            info = path.lstat()
            out[str(path)] = (info.st_size, info.st_mtime_ns)
    return out


HEADS = ["", "", "cd sub && ", "cd .. && ", "GIT_TRACE=1 ", "cd /tmp && ", "HOME=.. ", "cd ../.. && "]
TAILS = [
    "", "", " | grep x", " | sort -u", " >/dev/null", " 2>&1 | tail -n 1", " && echo ok", " > out",
    "; touch ../pwned", " | tee ../pwned", " && printf '%s' x", " 2>/dev/null | wc -l", " | jq -r .",
]  # fmt: skip
SUBCOMMANDS = ["push", "fetch", "pull", "clone", "ls-remote", "status", "commit"]
ROUNDS = 3000


def commands(rng: random.Random):
    """Half near-misses of host commands (a git network command with random arguments,
    heads and tails), half random pieces."""
    for _ in range(ROUNDS):
        if rng.random() < 0.5:
            args = " ".join(rng.choice(PIECES) for _ in range(rng.randint(0, 4)))
            yield f"{rng.choice(HEADS)}git {rng.choice(SUBCOMMANDS)} {args}".rstrip() + rng.choice(TAILS)
        else:
            pieces = [rng.choice(PIECES) for _ in range(rng.randint(1, 8))]
            yield ("" if rng.random() < 0.2 else " ").join(pieces)


def test_nothing_routed_to_the_host_writes_outside_the_code_dir(sandbox_dir):
    root = sandbox_dir
    code = root / "code"
    env = {"PATH": f"{root / 'bin'}:/usr/bin:/bin", "HOME": str(root / "home")}
    on_host = 0
    for command in commands(random.Random(20261129)):
        decided = route.route(command, [code], code / "repo")
        if decided.where != "host":
            continue
        on_host += 1
        before = state_outside(root)
        subprocess.run(
            ["bash", "-c", command], cwd=code / "repo", env=env, capture_output=True, timeout=10, check=False
        )
        assert state_outside(root) == before, f"{command!r} (routed to the host) wrote outside the code dir"
    assert on_host >= 150, f"only {on_host} of {ROUNDS} commands went to the host: the fuzzer proves little"


def test_the_same_pieces_do_write_outside_when_bash_runs_them_unchecked(sandbox_dir):
    """The hostile pieces are real: run without the router, some of them escape."""
    root = sandbox_dir
    code = root / "code"
    env = {"PATH": f"{root / 'bin'}:/usr/bin:/bin", "HOME": str(root / "home")}
    before = state_outside(root)
    subprocess.run(["bash", "-c", "git push $(touch ../../pwned)"], cwd=code / "repo", env=env, check=False)
    assert state_outside(root) != before
    (root / "pwned").unlink()
