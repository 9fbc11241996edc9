"""Host routing (clients/python/sbx_client/route.py): fixed cases. A command runs on the host only when
it is a git network command plus glue that cannot touch files, inside the code dirs."""

from __future__ import annotations

import os

import pytest

from sbx_client import route


@pytest.fixture
def tree(tmp_path):
    code = tmp_path / "code"
    (code / "repo" / "sub").mkdir(parents=True)
    (code / "other").mkdir()
    (tmp_path / "outside").mkdir()
    os.symlink(tmp_path / "outside", code / "escape")
    os.symlink(code / "other", code / "inner-link")
    return code


def where(tree, command: str, cwd: str = "repo") -> route.Route:
    return route.route(command, [tree], tree / cwd)


HOST = [
    "git push",
    "git push origin HEAD",
    "git push -u origin main",
    "git push --force-with-lease origin HEAD:refs/heads/x",
    "git fetch --all --prune",
    "git fetch --depth 1 origin",
    "git fetch --depth=1 origin",
    "git pull --rebase",
    "git ls-remote --heads origin",
    "git clone https://github.com/org/repo.git",
    "git clone https://github.com/org/repo.git sub/new",
    "git clone --depth 1 -b main git@github.com:org/repo.git",
    "cd sub && git fetch",
    "cd .. && git fetch",
    "git push 2>&1 | tail -n 5",
    "git fetch >/dev/null 2>/dev/null && echo fetched",
    "git ls-remote origin | grep -c refs/heads",
    "git ls-remote origin | cut -f2 | sort -u | head -3",
    "GIT_TRACE=1 git fetch",
    "git push origin 'refs/heads/a b'",
    "git push evil-or-not",  # a remote name: hostrun checks the repository has it
    "git push ssh://git@github.com/org/repo.git",
    "git fetch git://example.org/repo.git",
    "git push && git push --tags",
    "printf 'x' && git push",
]

SANDBOX = {
    "make test": "not a git",
    "git status": "network subcommand",
    "git commit -m x": "network subcommand",
    "git -c core.sshCommand=evil fetch": "network subcommand",
    "git -C /tmp fetch": "network subcommand",
    "git fetch --upload-pack=evil origin": "not on the list",
    "git push --receive-pack=evil origin": "not on the list",
    "git push --exec=evil origin": "not on the list",
    "git clone -u evil https://x/y": "not on the list",
    "git clone -c core.hooksPath=/tmp https://x/y": "not on the list",
    "git clone --template=/tmp/t https://x/y": "not on the list",
    "git clone --config x=y https://x/y": "not on the list",
    "git clone --separate-git-dir=/tmp/g https://x/y": "not on the list",
    "git clone --bare https://x/y": "not on the list",
    "git clone --recurse-submodules https://x/y": "not on the list",
    "git fetch 'ext::sh -c evil'": "runs a program",
    "git push fd::3": "runs a program",
    "git push $REMOTE": "meaning to the shell",
    'git push "$REMOTE"': "inside double quotes",
    "git push `evil`": "meaning to the shell",
    "git push $(evil)": "meaning to the shell",
    "git push ~/repo": "meaning to the shell",
    "git push origin *": "meaning to the shell",
    "git push origin ma?n": "meaning to the shell",
    "git push; rm -rf /": "meaning to the shell",
    "git push & evil": "meaning to the shell",
    "git push || evil": "meaning to the shell",
    "git push |& tee log": "meaning to the shell",
    "git push > log": "meaning to the shell",
    "git push >log": "meaning to the shell",
    "git push 2>log": "meaning to the shell",
    "git push < input": "meaning to the shell",
    "git push <<EOF": "meaning to the shell",
    "(git push)": "meaning to the shell",
    "{ git push; }": "meaning to the shell",
    "git push # comment": "meaning to the shell",
    "git push | tee log": "not a git network command or glue",
    "git push | grep x /etc/passwd": "reads a file",
    "git push | sort -o out": "not on the list",
    "git push | tail -f": "not on the list",
    "git push | jq -f prog.jq": "not a git network command or glue",
    "git ls-remote origin | jq -n env": "not a git network command or glue",
    "git ls-remote origin | grep -e '' secret.txt": "not on the list",
    "git push ./evil HEAD": "not a network URL or a remote name",
    "git push ../other": "not a network URL or a remote name",
    "git fetch file:///tmp/x": "not a network URL or a remote name",
    "git clone ../planted new": "not a network URL or a remote name",
    "git push https://tok@github.com/o/r.git": "not a network URL or a remote name",
    "git push 'https://github.com/o/r.git?private_token=1'": "credentials or a query",
    "git push xyz://host/x": "not a network URL or a remote name",
    "git push -origin": "not on the list",
    "git push 'https://github.com/o/r%0a.git'": "control characters",
    "git ls-remote | xargs rm": "not a git network command or glue",
    "HOME=/tmp git push": "not an on/off switch",
    "GIT_SSH_COMMAND=evil git push": "not an on/off switch",
    "GIT_TRACE=/tmp/log git push": "not an on/off switch",
    "cd /tmp && git push": "outside the code dirs",
    "cd ../.. && git push": "outside the code dirs",
    "cd ../escape && git push": "symlink",
    "cd ../inner-link && git push": "symlink",
    "cd nowhere && git push": "does not exist",
    "cd sub": "must lead into a command",
    "git clone https://x/y ../../elsewhere": "outside the code dirs",
    "git clone https://x/y ../escape/new": "symlink",
    "git push /tmp/repo": "not a network URL or a remote name",
    "git push file:///tmp/repo": "not a network URL or a remote name",
    "echo hi": "not a git network command",
    "echo x | git push": "feeding a pipe",
    "git push\nrm -rf /": "multi-line",
    "": "empty",
    "git push 'unterminated": "unterminated",
    "git push && ": "empty command",
}


@pytest.mark.parametrize("command", HOST)
def test_git_network_commands_and_harmless_glue_run_on_the_host(tree, command):
    decided = where(tree, command.format(code=tree))
    assert decided.where == "host", decided.why
    assert decided.plan is not None and decided.plan.cwd.is_relative_to(tree)


@pytest.mark.parametrize(("command", "why"), SANDBOX.items())
def test_everything_else_stays_in_the_sandbox_and_says_why(tree, command, why):
    decided = where(tree, command)
    assert decided.where == "sandbox" and decided.plan is None
    assert why in decided.why, decided.why


def test_a_working_directory_outside_the_code_dirs_keeps_everything_in_the_sandbox(tree):
    decided = route.route("git push", [tree], tree.parent / "outside")
    assert decided.where == "sandbox" and "outside the code dirs" in decided.why


def test_the_plan_is_argv_lists_not_text(tree):
    decided = where(tree, "cd sub && GIT_TRACE=1 git push origin 'a b' 2>&1 | grep -v x && echo done")
    plan = decided.plan
    assert plan.cwd == tree / "repo" / "sub" and plan.env == {"GIT_TRACE": "1"}
    (push, grep), (echo,) = plan.segments
    assert push.argv == ("git", "push", "origin", "a b") and push.stderr_to_stdout
    assert grep.argv == ("grep", "-v", "x") and echo.argv == ("echo", "done")


def test_clone_targets_in_the_plan_are_absolute_and_options_keep_their_place(tree):
    decided = where(tree, "git push --force origin main")
    ((push,),) = decided.plan.segments
    assert push.argv == ("git", "push", "--force", "origin", "main")
    decided = where(tree, f"git clone --depth 1 https://x/y.git -- {tree}/new")
    ((clone,),) = decided.plan.segments
    assert clone.argv == ("git", "clone", "--depth", "1", "https://x/y.git", "--", str(tree / "new"))
    decided = where(tree, "git clone https://x/y.git new")
    ((clone,),) = decided.plan.segments
    assert clone.argv[-1] == str(tree / "repo" / "new") and decided.plan.root == tree
