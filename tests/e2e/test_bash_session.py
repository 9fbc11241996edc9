"""The `shell` tool is one bash session: what an agent does in one call is there in the
next, as in a persistent bash, also when the executor was SIGKILLed between the two calls
(the next call lands on a new executor process with no memory of the session); and each
call's text runs as bash runs a script (compared with bash itself, in the same image). A
real `sbx up`, real sandboxes, the official MCP client over HTTP; one session per case."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import support
from tests.e2e import bash_cases
from tests.e2e.agent import Agent
from tests.e2e.bash_cases import CASES, Case, checked
from tests.e2e.stacks import running_stack
from tests.e2e.test_chaos import children

pytestmark = [
    pytest.mark.needs_root("the local runtime needs root"),
    pytest.mark.slow,
    pytest.mark.timeout(600),
]


async def _calls(agent: Agent, case: Case) -> list[tuple[bool, str]]:
    out = []
    for step in case.setup:
        command, timeout = step if isinstance(step, tuple) else (step, None)
        out.append(await agent.call("shell", command=command, **({"timeout": timeout} if timeout else {})))
    return out


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


MODES = ("nothing", "executor SIGKILL", "two executors")
"""What happens between a case's calls: nothing; the executor is SIGKILLed (the next call
lands on a new executor process with no memory of the session); a second executor
instance serves too (each call lands on either, at random)."""


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """One `sbx up` for the module's tests (new sessions per case: ~190 in all, some of
    them cleared as they go)."""
    state = tmp_path_factory.mktemp("bash") / "state"
    with running_stack(state, SBX_POOL_MIN_IDLE="8", SBX_MAX_RUNNING="250") as (proc, url):
        yield proc, state, url


def test_a_call_runs_as_bash_runs_a_script(stack):
    """Each text of the table through `shell` (a session of its own) and as a script run
    by a fresh bash in a sandbox of the same image (one shared session; each case in its
    own directory, the same in both): same output, exit status and state after; the
    cases that cannot match by design are listed, with the reason, and must still differ."""
    _, state, url = stack
    key = (state / "api-key").read_text().strip()
    wrong, listed = asyncio.run(_compare_all(url, key))
    for name, why in listed:
        print(f"\ndiffers by design: {name}: {why}")
    matched = len(bash_cases.COMPARED) - len(listed) - len(wrong)
    print(f"\nbash comparison: {matched} cases match bash, {len(listed)} differ by design")
    assert not wrong, "\n\n".join(wrong)


async def _compare_all(url: str, key: str) -> tuple[list[str], list[tuple[str, str]]]:
    reference = Agent(url, key, "bash-reference")
    limit = asyncio.Semaphore(6)

    async def one(i: int, case: bash_cases.Compared) -> str | None:
        where = f"/workspace/c{i}"
        ours = Agent(url, key, f"bash-ours-{i}")
        async with limit:
            ok, _ = await ours.call("shell", command=f"mkdir -p {where} && cd {where}")
            assert ok
            _, text = await ours.call("shell", command=case.text, timeout=60)
            output, _, status = bash_cases.split(text)
            state = ""
            if not case.ends:
                _, after = await ours.call("shell", command=bash_cases.probe(case))
                _, state, _ = bash_cases.split(after)
            path = f"/tmp/sbx-ref/{i}/command"
            script = bash_cases.reference(case, path, probed=not case.ends)
            _, text = await reference.call(
                "shell", command=f"mkdir -p {where} && cd {where} && {script}", timeout=60
            )
            ref_output, ref_state, ref_status = bash_cases.split(text.replace(path, bash_cases.SCRIPT_PATH))
            await ours.call("clear_session")  # (its sandbox goes: the stack's other tests need room)
        same = (output, state, status) == (ref_output, ref_state, ref_status)
        if case.differs is not None:
            return None if not same else f"{case.name}: listed as differing, yet matches bash: {output!r}"
        if same:
            return None
        return (
            f"{case.name} ({case.text!r}):\n  shell: {output!r} state {state!r} exit {status}\n"
            f"  bash:  {ref_output!r} state {ref_state!r} exit {ref_status}"
        )

    found = await asyncio.gather(*(one(i, c) for i, c in enumerate(bash_cases.COMPARED)))
    listed = [(c.name, c.differs) for c in bash_cases.COMPARED if c.differs is not None]
    return [w for w in found if w], listed


def test_the_shell_keeps_everything_a_bash_session_keeps(stack):
    """Every case in each mode on one stack (new sessions per mode)."""
    proc, state, url = stack
    if True:
        key = (state / "api-key").read_text().strip()
        wrong = {}
        for between in MODES:
            second = _second_executor(state) if between == "two executors" else None
            try:
                wrong[between] = asyncio.run(_run_cases(proc, url, key, between))
            finally:
                if second is not None:
                    second.terminate()
                    second.wait(30)
            passed = len(CASES) - len(wrong[between])
            print(f"\nbash session, {between} between the calls: {passed}/{len(CASES)} cases")
    assert not any(wrong.values()), wrong


def _second_executor(state: Path) -> subprocess.Popen[bytes]:
    """Another executor instance on the stack's bus, sharing its runtime (as a second
    replica would); serving once it reports healthy."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SBX_", "NATS_", "SANDBOX_"))}
    env |= {
        "NATS_URL": json.loads((state / "stack.json").read_text())["nats_url"],
        "NATS_TOKEN": (state / "nats-token").read_text().strip(),
        "SBX_STATE_DIR": str(state.resolve()),
        "SBX_METRICS_PORT": "0",
    }
    proc = subprocess.Popen([sys.executable, "-m", "services.executor"], env=env, cwd=support.ROOT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        report = subprocess.run(
            [sys.executable, "-m", "sbx.cli", "status", "--json", "--state-dir", str(state)],
            capture_output=True, text=True, cwd=support.ROOT,
        )  # fmt: skip
        services = json.loads(report.stdout or "{}").get("services", [])
        if sum(s["service"] == "executor" and s["status"] == "ok" for s in services) >= 2:
            return proc
        time.sleep(0.5)
    proc.kill()
    raise AssertionError("the second executor did not come up")


async def _run_cases(proc, url: str, key: str, between: str) -> list[str]:
    """Every case's first calls, then (after ``between``) its check; what went wrong."""
    mode = {"nothing": "n", "executor SIGKILL": "k", "two executors": "t"}[between]
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
            wrong = checked(case, ok, text)
            ok, alive = await agent.call("shell", command="echo alive")  # and the session goes on
            return wrong or (None if ok and "alive" in alive else f"{case.name}: unusable after: {alive}")

    started = time.monotonic()
    found = [w for w in await asyncio.gather(*(check(c) for c in CASES)) if w]
    print(f"checks {time.monotonic() - started:.1f}s")
    return found


WEDGES = (
    "set -n; echo notrun",
    "set -o noexec",
    "shopt -o -s noexec",
    "enable -n builtin",
    "enable -n eval printf",
    "unset __sbx_b",
    "__sbx_next=",
    "readonly __sbx_rc __sbx_al",
    "shopt -s extdebug; trap false DEBUG",
    "trap '' USR1 TERM INT HUP QUIT ALRM; echo traps",
    "set -T; trap ': debug' DEBUG; set -E; trap ': err' ERR; false",
    "PROMPT_COMMAND=exit; shopt -u expand_aliases; echo plain",
    "exec {__sbx_rp}>&-; echo closed",
    "exec {__sbx_rq}<&- {__sbx_w}>&- {__sbx_cw}>&-; echo closed",
    "exec {__sbx_rp}>/dev/null {__sbx_rq}</dev/null",
    "exec {__sbx_w}>&-; exit 3",
    "exec 10>/tmp/ten; echo ten >&10; exec 10>&-",
    "builtin() { :; }; command() { :; }",
    "a['2']=3; echo same-line",
)
"""Texts that turn the session's own bash against its machinery (noexec, its builtins
disabled, its variables changed, its fds closed, traps of its signals)."""


def test_no_text_wedges_the_session(stack):
    """Each call ends (with a clear note where its shell had to be replaced), long before
    its timeout, and the next call works with the state from before that call."""
    _, state, url = stack
    key = (state / "api-key").read_text().strip()

    async def one(i: int, text: str) -> str | None:
        agent = Agent(url, key, f"wedge-{i}")
        await agent.call("shell", command="x=kept")
        _, answer = await agent.call("shell", command=text, timeout=120)
        ok, after = await agent.call("shell", command='echo "$x alive"', timeout=120)
        await agent.call("clear_session")
        if "timed out" in answer or "kept alive" not in after or not ok:
            return f"{text!r}: {answer!r} then {after!r}"
        return None

    async def run_all() -> list[str]:
        limit = asyncio.Semaphore(6)

        async def bounded(i: int, text: str) -> str | None:
            async with limit:
                return await one(i, text)

        found = await asyncio.gather(*(bounded(i, t) for i, t in enumerate(WEDGES)))
        return [w for w in found if w]

    wrong = asyncio.run(run_all())
    assert not wrong, "\n".join(wrong)
