"""The table of bash cases the `shell` tool must pass as one bash session would (issue 18):
each case's setup calls, then a check call and what its answer must (and must not) show.
Used by `tests/e2e/test_bash_session.py` and, against SWE-ReX too, `bench/bash_session.py`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Case:
    name: str
    setup: tuple[str | tuple[str, float], ...]
    """Calls made first: a command, or (command, timeout)."""
    check: str
    expect: tuple[str, ...]
    absent: tuple[str, ...] = field(default=())


CASES = (
    Case("variable", ("x=41",), "echo $((x+1))", ("42",)),
    Case("function", ('greet() { echo "hi $1"; }',), "greet bob", ("hi bob",)),
    Case("alias", ("alias ll='echo listing'",), "ll", ("listing",)),
    Case("array", ('arr=(a "b c" d)',), 'echo "${arr[1]}|${#arr[@]}"', ("b c|3",)),
    Case("assoc", ("declare -A m=([k]=v [two words]=w)",), 'echo "${m[k]}${m[two words]}"', ("vw",)),
    Case("integer", ("declare -i n=5",), "n+=2; echo $n", ("7",)),
    Case("pipefail", ("set -o pipefail",), "false | true; echo rc=$?", ("rc=1",)),
    Case("umask", ("umask 077",), "umask; touch /tmp/u; stat -c %a /tmp/u", ("0077", "600")),
    Case("pushd", ("cd /tmp && pushd /usr >/dev/null",), "popd >/dev/null; pwd", ("/tmp",)),
    Case(
        "venv",
        ("python3 -m venv --without-pip /tmp/v && source /tmp/v/bin/activate",),
        'echo "$VIRTUAL_ENV"; type -t deactivate; deactivate; echo "[${VIRTUAL_ENV-}]"',
        ("/tmp/v", "function", "[]"),
    ),
    Case("errexit", ("set -e",), "false; echo after", ("[exit code: 1]",), absent=("after",)),
    Case("trap", ("trap 'echo caught' USR1",), "kill -USR1 $$; sleep 0.2", ("caught",)),
    Case("ulimit", ("ulimit -n 256",), "ulimit -n", ("256",)),
    Case(
        "export -n",
        ("export FOO=1; export -n FOO",),
        "echo \"[$FOO]\"; env | grep -c '^FOO=' || true",
        ("[1]", "\n0\n"),
    ),
    Case("unset -f", ("f() { :; }", "unset -f f"), "type -t f || echo gone", ("gone",)),
    Case("readonly", ("declare -r RO=1",), "echo RO=$RO; RO=2", ("RO=1", "readonly variable")),
    Case(
        "globstar",
        ("shopt -s globstar; mkdir -p /tmp/g/a/b && touch /tmp/g/a/b/z.txt",),
        "cd /tmp/g && echo **/*.txt",
        ("a/b/z.txt",),
    ),
    Case("cd -", ("cd /tmp; cd /usr",), "cd - >/dev/null; pwd", ("/tmp",)),
    Case("OLDPWD", ("cd /etc; cd /usr",), 'echo "$OLDPWD"', ("/etc",)),
    Case(
        "PATH",
        (
            "mkdir -p /tmp/bin && printf '#!/bin/sh\\necho mytool\\n' > /tmp/bin/mytool",
            "chmod +x /tmp/bin/mytool; PATH=/tmp/bin:$PATH",
        ),
        "mytool",
        ("mytool",),
    ),
    Case(
        "nvm-style",
        ('nvm_use() { export NODE_VERSION=$1; PATH="/opt/node-$1/bin:$PATH"; }; nvm_use 20',),
        'echo "$NODE_VERSION"; type -t nvm_use; echo "${PATH%%:*}"',
        ("20", "function", "/opt/node-20/bin"),
    ),
    Case(
        "background server",
        ("python3 -m http.server 8765 --bind 127.0.0.1 >/dev/null 2>&1 & sleep 1; echo started",),
        "python3 -c \"import urllib.request as u; print(u.urlopen('http://127.0.0.1:8765/').status)\"",
        ("200",),
    ),
    # A call that ends the shell (exit, set -e, a fatal signal, a timeout) leaves the
    # state from before that call.
    Case("exit", ("y=1", "y=2; exit 7"), 'echo "y=$y"', ("y=1",)),
    Case("timeout", ("z=before", ("z=changed; sleep 30", 1.0)), 'echo "z=$z"', ("z=before",)),
    Case("read", (), 'read x; echo "rc=$?"', ("rc=1",)),
    Case("nounset", ("set -u",), 'echo "${nope:-default}"; echo $nope; echo after', ("default",), ("after",)),
    Case("xtrace", ("set -x",), "echo traced", ("+ echo traced", "traced")),
    Case("positional", ('set -- a "b c"',), 'echo "$#|$2"', ("2|b c",)),
    Case(
        "removed cwd",
        ("mkdir -p /tmp/gone && cd /tmp/gone && rmdir /tmp/gone",),
        "pwd",
        ("no longer exists", "/workspace"),
    ),
    Case("heredoc", ("cat > /tmp/h.txt <<'EOF'\nline1\nEOF",), "cat /tmp/h.txt", ("line1",)),
)


def checked(case: Case, ok: bool, text: str) -> str | None:
    """What is wrong with a check's answer (None if right)."""
    if not ok:
        return f"{case.name}: the call failed: {text}"
    missing = [e for e in case.expect if e not in text]
    present = [a for a in (*case.absent, "__sbx") if a in text]
    return f"{case.name}: missing {missing}, present {present} in {text!r}" if missing or present else None
