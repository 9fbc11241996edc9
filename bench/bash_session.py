"""The `shell` tool as a bash session, side by side with SWE-ReX (its in-process
``LocalRuntime``: a live bash under pexpect, the design most agent harnesses use).

Prints, all in the same run:

* the case table of ``tests/e2e/bash_cases.py`` (state that must carry over between calls,
  ``exit``, timeouts, traps, …), one session per case: through our MCP `shell` against
  `sbx up` (real sandboxes), and through SWE-ReX on this host; each one's pass count, the
  cases it failed, and its per-call latency;
* `shell` of `true` in a live session vs a no-op MCP tool call (a tool call the gateway
  refuses before doing any work), interleaved on one client: p50/p99 and the ratio
  (target: at most 2x, shell p50 at most 5 ms), and SWE-ReX's `true`.

SWE-ReX runs in an interpreter of its own: ``bench/.swerex`` (made with ``uv`` on first
use: ``swe-rex==1.4.0``), fed the cases as JSON. Its sessions run on this host, as the
bench's user, in a scratch directory (the cases also write under ``/tmp``). Figures only;
nothing is asserted.

    .venv/bin/python bench/bash_session.py [--calls 200]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common
from bench.agents import Agent, start_stack, stop_stack, timed
from tests.e2e.bash_cases import CASES, Case, checked

SWEREX = Path(__file__).resolve().parent / ".swerex"
SWEREX_VERSION = "1.4.0"

SWEREX_RUNNER = r"""
import asyncio, json, os, sys, time
from swerex.runtime.abstract import BashAction, CloseBashSessionRequest, CreateBashSessionRequest
from swerex.runtime.local import LocalRuntime

cases, calls = json.load(sys.stdin), int(sys.argv[1])

async def main():
    rt, results, latencies = LocalRuntime(), [], []

    async def call(session, command, timeout):
        start = time.perf_counter()
        try:
            obs = await rt.run_in_session(
                BashAction(session=session, command=command, timeout=timeout or 120, check="silent")
            )
            answer = (True, obs.output + f"\n[exit code: {obs.exit_code}]")
        except Exception as exc:  # a timeout or a dead session: what an agent would get
            answer = (False, f"{type(exc).__name__}: {exc}")
        latencies.append(time.perf_counter() - start)
        return answer

    for i, case in enumerate(cases):
        session = f"case{i}"
        await rt.create_session(CreateBashSessionRequest(session=session, startup_timeout=10))
        for command, timeout in case["setup"]:
            await call(session, command, timeout)
        ok, text = await call(session, case["check"], None)
        alive_ok, alive = await call(session, "echo alive", None)
        results.append({"ok": ok, "text": text, "alive": alive_ok and "alive" in alive})
        try:
            await rt.close_session(CloseBashSessionRequest(session=session))
        except Exception:
            pass
    await rt.create_session(CreateBashSessionRequest(session="true"))
    true_s = []
    for _ in range(calls):
        start = time.perf_counter()
        await rt.run_in_session(BashAction(session="true", command="true", check="silent"))
        true_s.append(time.perf_counter() - start)
    print(json.dumps({"results": results, "latencies": latencies, "true": true_s}))

asyncio.run(main())
"""


def swerex_python() -> Path:
    python = SWEREX / "bin" / "python"
    if not python.exists():
        uv = shutil.which("uv") or str(Path(sys.executable).parent / "uv")
        subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(SWEREX)], check=True)
        subprocess.run(
            [uv, "pip", "install", "-q", "--python", str(python), f"swe-rex=={SWEREX_VERSION}"], check=True
        )
    return python


def _steps(case: Case) -> list[tuple[str, float | None]]:
    return [step if isinstance(step, tuple) else (step, None) for step in case.setup]


def run_swerex(calls: int) -> dict:
    cases = [{"setup": _steps(c), "check": c.check} for c in CASES]
    with tempfile.TemporaryDirectory(prefix="swerex-") as scratch:
        done = subprocess.run(
            [str(swerex_python()), "-c", SWEREX_RUNNER, str(calls)],
            input=json.dumps(cases), capture_output=True, text=True, cwd=scratch, timeout=1800,
        )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError("SWE-ReX run failed:\n" + done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


class Caller(Agent):
    """An MCP connection that keeps each `shell` answer."""

    async def answer(self, command: str, timeout: float | None = None) -> tuple[bool, str]:
        arguments: dict[str, object] = {"command": command}
        if timeout is not None:
            arguments["timeout"] = timeout
        result = await self._session.call_tool("shell", arguments)
        return not result.is_error, "".join(getattr(c, "text", "") for c in result.content)


async def run_ours(url: str, key: str, calls: int) -> dict:
    results, latencies = [], []
    for i, case in enumerate(CASES):
        async with Caller(url, key, f"bench-case-{i}") as agent:

            async def call(command: str, timeout: float | None) -> tuple[bool, str]:
                start = time.perf_counter()
                answer = await agent.answer(command, timeout)
                latencies.append(time.perf_counter() - start)
                return answer

            for command, timeout in _steps(case):
                await call(command, timeout)
            ok, text = await call(case.check, None)
            alive_ok, alive = await call("echo alive", None)
            results.append({"ok": ok, "text": text, "alive": alive_ok and "alive" in alive})
    shell_s: list[float] = []
    noop_s: list[float] = []
    async with Caller(url, key, "bench-true") as agent:
        for _ in range(20):  # warm up
            await agent.shell("true")
        for _ in range(calls):
            await timed(shell_s, agent.shell("true"))
            await timed(noop_s, agent.noop_tool())
    return {"results": results, "latencies": latencies, "true": shell_s, "noop": noop_s}


def report(name: str, run: dict) -> None:
    failed = []
    for case, result in zip(CASES, run["results"], strict=True):
        wrong = checked(case, result["ok"], result["text"])
        if wrong or not result["alive"]:
            failed.append(case.name + ("" if result["alive"] else " (session unusable after)"))
    passed = len(CASES) - len(failed)
    listed = f"; failed: {', '.join(failed)}" if failed else ""
    print(f"\n{name}: {passed}/{len(CASES)} cases pass{listed}")
    print(common.row(f"{name}: every call of the table", run["latencies"], sum(run["latencies"])))
    print(common.row(f"{name}: `true` in a live session", run["true"], sum(run["true"])))


async def main(calls: int) -> None:
    state = Path(tempfile.mkdtemp(prefix="sbx-bench-bash-")) / "state"
    proc, base = start_stack(state, pool=4)
    try:
        key = (state / "api-key").read_text().strip()
        ours = await run_ours(f"{base}/mcp", key, calls)
    finally:
        stop_stack(proc, state)
    theirs = run_swerex(calls)
    print("\nbash session: our MCP `shell` (sbx up, local runtime) vs SWE-ReX LocalRuntime (this host)")
    report("ours", ours)
    print(common.row("ours: no-op MCP tool call", ours["noop"], sum(ours["noop"])))
    report("SWE-ReX", theirs)
    shell_p, noop_p = common.percentiles(ours["true"]), common.percentiles(ours["noop"])
    swerex_p = common.percentiles(theirs["true"])
    print(
        "\nshell/no-op tool ratio (target <= 2x, shell p50 <= 5 ms): "
        f"p50 {shell_p['p50'] / noop_p['p50']:.2f}x (shell p50 {shell_p['p50']:.2f} ms)  "
        f"p99 {shell_p['p99'] / noop_p['p99']:.2f}x"
    )
    print(f"SWE-ReX / our shell `true`: p50 {swerex_p['p50'] / shell_p['p50']:.2f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    asyncio.run(main(args.calls))
