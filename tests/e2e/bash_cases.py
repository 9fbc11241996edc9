"""The table of bash cases the `shell` tool must pass as one bash session would (issue 18):
each case's setup calls, then a check call and what its answer must (and must not) show.
Used by `tests/e2e/test_bash_session.py` and, against SWE-ReX too, `bench/bash_session.py`."""

from __future__ import annotations

import base64
import re
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
    # The session's own code runs amid whatever the agent set: POSIX mode, noclobber,
    # nounset, an odd IFS, TMOUT, aliases named like builtins, a DEBUG trap; also in a
    # shell that took over after `exit`.
    Case(
        "hostile settings",
        (
            "set -o posix -C -u; IFS=x; TMOUT=1; alias builtin='echo A' eval='echo A'; "
            "trap 'echo dbg >/dev/null' DEBUG; v=1",
            "echo once; exit 4",
        ),
        "set +o posix; set -e; echo v=$v; false",
        ("v=1", "[exit code: 1]"),
    ),
)


def checked(case: Case, ok: bool, text: str) -> str | None:
    """What is wrong with a check's answer (None if right)."""
    if not ok:
        return f"{case.name}: the call failed: {text}"
    missing = [e for e in case.expect if e not in text]
    present = [a for a in (*case.absent, "__sbx") if a in text]
    return f"{case.name}: missing {missing}, present {present} in {text!r}" if missing or present else None


# -- The same text through `shell` and through bash itself (issue 35) ------------------


@dataclass(frozen=True)
class Compared:
    """A call's text, run once through the `shell` tool and once as a script by a fresh
    bash in the same image (``bash FILE 2>&1``, stdin /dev/null, same directory): the
    output (stdout and stderr as one stream), the exit status and, unless the text ends
    the shell, the state after (``vars``, the directory, ``$-``) must be the same."""

    name: str
    text: str
    vars: tuple[str, ...] = ()
    ends: bool = False
    """The state after is not compared: the text ends the shell (a script would exit; the
    session goes on with the state from before the call, by design), or leaves a
    construct open so that nothing can follow it in the same script."""
    differs: str | None = None
    """Why this case cannot match by design; it is then expected to differ."""


_BIG = "x" * 100_000

COMPARED = (
    # Expansion and assignment errors abort their command only; nothing is rolled back.
    Compared("arithmetic error", 'x=1; echo $((1/0)); y=2\necho "x=$x y=${y-unset}"\nz=3', ("x", "y", "z")),
    Compared("readonly assignment", "readonly r=1; r=2; echo same-line\necho next r=$r\nw=1", ("r", "w")),
    Compared("bad substitution", 'echo before; echo "${a!}"; echo same\necho next; v=1', ("v",)),
    Compared("arithmetic syntax", "echo $((12 34)); echo same\necho next; v=2", ("v",)),
    Compared("continue with arguments", "continue 1 2 3; echo after; v=3", ("v",)),
    Compared("cd and export kept past an error", 'cd /tmp; export E=1; z=$((1/0))\necho "$PWD $E"', ("E",)),
    Compared("unset variable in arithmetic", "n=$((1 + )); echo same\necho next; n=4", ("n",)),
    # Reopening the call's own output never loses what was written before.
    Compared(">/dev/stdout", "echo one; echo two >/dev/stdout; echo three"),
    Compared(">/dev/stderr", "echo one; echo two >/dev/stderr; echo three"),
    Compared("/proc/self/fd/1", "echo one; echo two >/proc/self/fd/1; echo three"),
    Compared("tee /dev/stderr", "echo one; echo two | tee /dev/stderr >/dev/null; echo three"),
    Compared("exec 3>/dev/stdout", "echo one; exec 3>/dev/stdout; echo two >&3; exec 3>&-; echo three"),
    Compared(
        "python O_TRUNC",
        "echo one; python3 -c \"open('/dev/stderr', 'w').write('two\\n')\"; echo three",
    ),
    # Loops, line numbers, the process running the code.
    Compared("top-level continue", "echo a; continue; echo b; v=5", ("v",)),
    Compared("top-level break", "echo a; break; echo b; v=6", ("v",)),
    Compared("break in a loop", "for i in 1 2 3; do [ $i = 2 ] && break; echo $i; done; echo end"),
    Compared("LINENO", "echo $LINENO\n\necho $LINENO\nf() {\n  echo $LINENO\n}\nf"),
    Compared("error line numbers", "true\nnosuchcmd_x\necho $((1/0))\necho $LINENO"),
    Compared(
        "xtrace",
        "set -x\necho traced\n: $((1 + 1))\nset +x",
        differs=(
            "the call runs as a script sourced by the session's bash: each trace line has one "
            "more level of PS4's first character ('++' where a script shows '+')"
        ),
    ),
    Compared("BASH_SUBSHELL", "echo $BASH_SUBSHELL $(echo $BASH_SUBSHELL) $( (echo $BASH_SUBSHELL) )"),
    Compared("$$ runs the code", '[ "$$" = "$BASHPID" ] && echo same'),
    Compared("signal to $$ reaches the trap", "trap 'echo urg' URG; kill -URG $$; echo after; trap - URG"),
    Compared("TERM to $$ with a trap", "trap 'echo term' TERM; kill -TERM $$; echo after; trap - TERM"),
    Compared("wait %1 on a finished job", "sleep 0.1 & sleep 0.4; wait %1; echo rc=$?"),
    Compared("wait -n on a finished job", "sleep 0.1 & p=$!; sleep 0.4; wait -n $p; echo rc=$?"),
    Compared("wait for a status", "(exit 3) & wait $!; echo rc=$?; false & wait $!; echo rc=$?"),
    Compared("no stdin", 'read -r line; echo "rc=$? [$line]"; cat; echo rc=$?'),
    # Here-documents.
    Compared("here-document", "x=2\ncat <<EOF\nx=$x $((1 + 1))\nEOF\necho after"),
    Compared("quoted here-document", "cat <<'EOF'\n$HOME `x`\nEOF"),
    Compared("here-document <<-", "cat <<-EOF\n\tindented\n\tEOF\necho after"),
    Compared("here-string", "tr a-z A-Z <<< hello"),
    Compared("unterminated here-document", "echo before\ncat <<EOF\nline", ends=True),
    # set -e, set -u, pipefail.
    Compared("errexit handled", "set -e; false || echo handled; if false; then :; fi; echo end; set +e"),
    Compared("errexit last command exempt", "set -e\n[ -f /nonexistent ] && echo found"),
    Compared("errexit ends the shell", "set -e; echo before; false; echo notreached", ends=True),
    Compared("errexit in a function", "set -e; f() { false; echo in-f; }; f || echo caught; set +e"),
    Compared("nounset ends the shell", 'set -u; echo "${nope:-d}"; echo $nope; echo after', ends=True),
    Compared("pipefail", "set -o pipefail; false | true; echo $?; set +o pipefail; false | true; echo $?"),
    Compared("errexit with pipefail", "set -eo pipefail; false | true; echo notreached", ends=True),
    Compared("${x:?} ends the shell", ": ${undefined_var:?custom message}; echo after", ends=True),
    # Traps.
    Compared("ERR trap", "trap 'echo err $?' ERR; false; echo next; trap - ERR"),
    Compared(
        "ERR with errtrace", "set -E; trap 'echo ERR line $LINENO' ERR; f() { false; }; f; trap - ERR; set +E"
    ),
    Compared("DEBUG trap", "trap 'echo \"dbg $BASH_COMMAND\"' DEBUG; echo a; trap - DEBUG"),
    Compared(
        "RETURN trap",
        "trap 'echo ret' RETURN; f() { :; }; f; . /dev/null; echo end",
        differs=(
            "the call's script is itself sourced: a RETURN trap set at the top level also runs "
            "when the call ends"
        ),
    ),
    Compared("EXIT trap in a subshell", "( trap 'echo sub-exit' EXIT; echo in ); echo after"),
    Compared(
        "EXIT trap at the top level",
        "trap 'echo bye' EXIT; echo hi",
        differs=(
            "the session's shell goes on after the call: an EXIT trap runs when the shell ends "
            "(exit, a timeout), not at the end of every call"
        ),
    ),
    Compared("trap -p", "trap 'echo x' USR2; trap -p USR2; trap - USR2"),
    # Arrays.
    Compared("indexed array", "a=(1 2 3); a+=(4); echo ${#a[@]} ${a[-1]} ${a[@]:1:2}", ("a",)),
    Compared("associative array", "declare -A m=([k]=v); m[x]=y; echo ${m[k]}${m[x]}", ("m",)),
    Compared("sparse array", "a=(1 2 3); unset 'a[1]'; echo ${!a[@]}", ("a",)),
    Compared("mapfile", "mapfile -t l < <(printf 'a\\nb\\n'); echo ${#l[@]}", ("l",)),
    # shopt.
    Compared("extglob on the next line", "shopt -s extglob\nx=abc; echo ${x/@(a|b)/X}\nshopt -u extglob"),
    Compared("nullglob", "shopt -s nullglob; echo [none]*; echo end; shopt -u nullglob"),
    Compared("failglob", "shopt -s failglob; echo nomatch*; echo after; shopt -u failglob"),
    Compared("aliases after expand_aliases", "shopt -s expand_aliases\nalias hi='echo hello'\nhi"),
    Compared(
        "aliases by default",
        "alias hi='echo hello'\nhi",
        differs=(
            "aliases expand in the session as in an interactive bash (a script does not expand "
            "them unless `shopt -s expand_aliases`)"
        ),
    ),
    # read.
    Compared("read fields", 'read -r a b <<< "1 2 3"; echo "$a|$b"', ("a", "b")),
    Compared("read -a with IFS", 'IFS=, read -ra p <<< "x,y,z"; echo ${p[1]}', ("p",)),
    Compared("read -t at end of input", "read -t 0.1 x; echo rc=$?"),
    Compared("read -d ''", "printf 'a\\0b\\0' | while IFS= read -rd '' w; do echo \"[$w]\"; done"),
    # Job control.
    Compared("jobs", "sleep 0.3 & jobs; wait; echo done"),
    Compared("kill %1", "sleep 5 & kill %1; wait %1; echo rc=$?"),
    # Process substitution.
    Compared("process substitution", "diff <(echo a) <(echo b); echo rc=$?; cat <(printf 'p\\n')"),
    # exec redirections.
    Compared("exec to a file", "exec 3>out.txt; echo to3 >&3; exec 3>&-; cat out.txt"),
    Compared("exec 2>&1", "exec 2>&1; echo err >&2; echo out"),
    Compared(
        "exec >file and back",
        "exec 4>&1; exec >log.txt; echo hidden; exec 1>&4 4>&-; echo shown; cat log.txt",
    ),
    # ulimit, umask.
    Compared("ulimit", "ulimit -n 200; ulimit -n; ulimit -c 0; ulimit -c"),
    Compared("umask", "umask 027; umask; touch f; stat -c %a f"),
    # Locale and bytes that are not UTF-8.
    Compared("non-UTF-8 output", "printf '\\xff\\xfe ok\\n'"),
    Compared("UTF-8 length", "LC_ALL=C.UTF-8; s='héllo'; echo ${#s}; unset LC_ALL"),
    Compared("C locale length", "LC_ALL=C; s='héllo'; echo ${#s}; unset LC_ALL"),
    # Very long lines.
    Compared("long output line", "head -c 20000 /dev/zero | tr '\\0' x; echo"),
    Compared("long command line", f'echo "{_BIG}" | wc -c'),
    Compared("long variable", "x=$(printf 'a%.0s' {1..50000}); echo ${#x}"),
    # Syntax.
    Compared("syntax error mid-text", "echo one\nif then\necho two", ends=True),
    Compared("unterminated quote", "echo before\necho 'abc", ends=True),
    Compared(
        "return at the top level",
        "return 3; echo after",
        differs=(
            "the call's script is sourced: a top-level `return` ends the call with its status "
            "(a script reports an error and goes on)"
        ),
    ),
    Compared("exit", "echo bye; exit 5", ends=True),
    # Odds and ends that state carries.
    Compared("function and local", 'f() { local v=1; echo $v; }; f; echo "[${v-}]"'),
    Compared("integer attribute", "declare -i n=5; n+=2; echo $n", ("n",)),
    Compared("nameref", "declare -n r=t; t=5; echo $r", ("r", "t")),
    Compared("positional parameters", 'set -- a "b c"; echo $#; shift; echo "$1"'),
    Compared("PIPESTATUS", "true | false | true; echo ${PIPESTATUS[@]}"),
    Compared("getopts", "set -- -a -b x; while getopts ab: o; do echo $o ${OPTARG-}; done"),
    Compared("printf -v", "printf -v out '%05d' 42; echo $out", ("out",)),
    Compared("options", "echo $-; set -f; echo $-; set +f"),
    Compared("verbose", "set -v\necho verbose\nset +v"),
    Compared("cd errors", "cd /nonexistent; echo rc=$?; cd -- /tmp && pwd"),
    Compared("type and command -v", "type -t cd; command -v ls; type -t nosuch || echo none"),
    Compared("subshell exit status", "(exit 4); echo $?; ( set -e; false; echo no ); echo $?"),
    Compared("brace expansion", "echo {a,b}{1,2} {1..3}"),
    Compared("enable -n", "enable -n echo; echo hi; enable echo; type -t echo"),
)

PROBE_MARK = "<<state after>>"
SCRIPT_PATH = "/.sbx-out/command"
"""The file each call's text is sourced from (its error messages name it)."""


def probe(case: Compared) -> str:
    """What prints the state after the text (run after it, in the same shell; an EXIT
    trap is left to run when that shell ends)."""
    declares = "".join(f"declare -p {v} 2>/dev/null || echo 'unset {v}'; " for v in case.vars)
    return (
        "{ set +xv; } 2>/dev/null; "
        f'printf "%s\\n" "{PROBE_MARK}"; echo "$PWD $-"; {declares}'
        "trap - ERR DEBUG RETURN"
    )


def reference(case: Compared, path: str, probed: bool) -> str:
    """The text as a script at ``path``, run by a fresh bash (then, if ``probed``, the
    state probe), as one `shell` call: bash's output, the probe's, the script's status."""
    script = case.text + ("\n__ref_rc=$?\n" + probe(case) + "\nexit $__ref_rc\n" if probed else "")
    encoded = base64.b64encode(script.encode()).decode()
    return (
        f"mkdir -p {path.rsplit('/', 1)[0]} && printf %s {encoded} | base64 -d >| {path} && "
        # (through a pipe of its own, as a terminal would show it, whatever the tool does)
        f"( bash {path} </dev/null 2>&1 | cat; exit ${{PIPESTATUS[0]}} )"
    )


_NOT_UTF8 = re.compile(r"\n\[\d+ byte\(s\) that are not UTF-8 text shown as \\xNN\]\n$")


def split(text: str) -> tuple[str, str, str]:
    """A `shell` answer as (output, state, exit status); the state is '' where not probed.
    (The note on bytes that are not UTF-8 closes the whole answer: it goes with the output.)"""
    body, _, status = text.rpartition("[exit code: ")
    note = _NOT_UTF8.search(body)
    body = body[: note.start()] if note else body
    output, _, state = body.partition(PROBE_MARK + "\n")
    output = output if not output or output.endswith("\n") else output + "\n"
    return output + (note.group().lstrip("\n") if note else ""), state, status.rstrip("]\n")
