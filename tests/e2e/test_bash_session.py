"""The `shell` tool is one bash session: what an agent does in one call is there in the
next, as in a persistent bash, also when the executor was SIGKILLed between the two calls
(the next call lands on a new executor process with no memory of the session). A real
`sbx up`, real sandboxes, the official MCP client over HTTP; one session per case."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass, field

import pytest

from tests.e2e.test_chaos import children
from tests.e2e.test_mcp import Agent
from tests.e2e.test_sbx_up import running_stack

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="the local runtime needs root"),
    pytest.mark.slow,
    pytest.mark.timeout(600),
]


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


async def _calls(agent: Agent, case: Case) -> list[tuple[bool, str]]:
    out = []
    for step in case.setup:
        command, timeout = step if isinstance(step, tuple) else (step, None)
        out.append(await agent.call("shell", command=command, **({"timeout": timeout} if timeout else {})))
    return out


def _checked(case: Case, ok: bool, text: str) -> str | None:
    """What is wrong with a check's answer (None if right)."""
    if not ok:
        return f"{case.name}: the call failed: {text}"
    missing = [e for e in case.expect if e not in text]
    present = [a for a in (*case.absent, "__sbx") if a in text]
    return f"{case.name}: missing {missing}, present {present} in {text!r}" if missing or present else None


async def _until_a_call_works(agent: Agent, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ok, _ = await agent.call("shell", command="true")
            if ok:
                return
        except Exception:  # the executor restarting
            pass
        await asyncio.sleep(0.2)
    raise AssertionError("no call worked after the executor's restart")


def test_the_shell_keeps_everything_a_bash_session_keeps(tmp_path):
    """Every case twice on one stack: with nothing between its calls, then (new sessions)
    with the executor SIGKILLed between them."""
    with running_stack(tmp_path / "state", SBX_POOL_MIN_IDLE="8") as (proc, url):
        key = (tmp_path / "state" / "api-key").read_text().strip()
        wrong = {}
        for between in ("nothing", "executor SIGKILL"):
            wrong[between] = asyncio.run(_run_cases(proc, url, key, between))
            passed = len(CASES) - len(wrong[between])
            print(f"\nbash session, {between} between the calls: {passed}/{len(CASES)} cases")
    assert not any(wrong.values()), wrong


async def _run_cases(proc, url: str, key: str, between: str) -> list[str]:
    """Every case's first calls, then (after ``between``) its check; what went wrong."""
    mode = "k" if between != "nothing" else "n"
    agents = {c.name: Agent(url, key, f"{mode}-" + c.name.replace(" ", "-")) for c in CASES}
    limit = asyncio.Semaphore(12)

    async def setup(case: Case) -> None:
        async with limit:
            await _calls(agents[case.name], case)

    started = time.monotonic()
    await asyncio.gather(*(setup(c) for c in CASES))
    print(f"\nsetup {time.monotonic() - started:.1f}s")
    if between == "executor SIGKILL":
        executor = children(proc.pid)["executor"]
        os.kill(executor, signal.SIGKILL)
        await _until_a_call_works(Agent(url, key, f"probe-{mode}"))
        assert children(proc.pid)["executor"] != executor

    async def check(case: Case) -> str | None:
        async with limit:
            agent = agents[case.name]
            ok, text = await agent.call("shell", command=case.check)
            wrong = _checked(case, ok, text)
            ok, alive = await agent.call("shell", command="echo alive")  # and the session goes on
            return wrong or (None if ok and "alive" in alive else f"{case.name}: unusable after: {alive}")

    started = time.monotonic()
    found = [w for w in await asyncio.gather(*(check(c) for c in CASES)) if w]
    print(f"checks {time.monotonic() - started:.1f}s")
    return found
