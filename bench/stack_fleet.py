"""The whole product with many live sessions: `sbx up`, real sandboxes, MCP agents.

Fills ``--count`` sessions in waves of ``--wave`` at once (each a new MCP connection:
initialize, tools/list, one `shell`), with the stack's own settings (a disk of its own per
sandbox, proxy egress, the pool autosized) and ``SBX_MAX_RUNNING`` sized for the fleet.
Prints, all from the same run:

* first `shell` (from connecting) p50/p99 per stretch of the fill, next to a no-op MCP
  tool call measured on the same stack at the same moment (an idle live session), and
  the ratio;
* at ``--small`` live sessions and at ``--count``, with every sandbox idle: the CPU of
  each process of the stack over ``--idle-seconds`` (services by name, the proxies, NATS),
  their memory (RSS), the reaper's pass time (its ``sbx_reaper_pass_seconds``, passes every
  ``--reaper-interval``), `sbx status` and the console's pages (sessions, sandboxes,
  system), and how many proxies run;
* every session reached again (a second `shell` each, in waves) and its egress (a request
  through its proxy, answered by the proxy: this machine has no internet);
* `sbx down` (SIGTERM to `sbx up`: services drain, sandboxes stopped, proxies, NATS) and
  what is left after it: mounts under the state dir, bound loop devices of its images,
  cgroups, host veths, processes.

Figures only; nothing is asserted. Needs root. Sandboxes of sessions outlive `sbx down`
(stopped, files kept): the benchmark deletes them afterwards.

    .venv/bin/python bench/stack_fleet.py [--count 1000] [--small 100] [--wave 25] [--root OTHER_CHECKOUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx2

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import agents, common
from shared.runtime.local import mounts

NOOPS = 30
STRETCHES = 5


def tree(root: int) -> dict[int, str]:
    """Every process under ``root`` (``root`` included): pid -> name as ``common`` names it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out: dict[int, str] = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        found = common._cpu_of(pid)
        if found is not None:
            out[pid] = found[0]
    return out


def memory_by_name(pids: dict[int, str]) -> dict[str, tuple[int, float, float]]:
    """name -> (processes, MiB of RSS summed, MiB of PSS summed: shared pages divided
    among the processes sharing them, so forked copies are not counted many times)."""
    out: dict[str, tuple[int, float, float]] = {}
    for pid, name in pids.items():
        try:
            rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
        except OSError:
            continue
        rss, pss = (re.search(rf"^{k}:\s+(\d+) kB", rollup, re.M) for k in ("Rss", "Pss"))
        n, r, p = out.get(name, (0, 0.0, 0.0))
        out[name] = (
            n + 1,
            r + (int(rss.group(1)) if rss else 0) / 1024,
            p + (int(pss.group(1)) if pss else 0) / 1024,
        )
    return out


async def noop_p(agent: agents.Agent) -> dict[str, float]:
    samples: list[float] = []
    for _ in range(NOOPS):
        await agents.timed(samples, agent.noop_tool())
    return common.percentiles(samples)


async def first_shell(url: str, key: str, session: str) -> float:
    t0 = time.perf_counter()
    async with agents.Agent(url, key, session) as agent:
        await agent.shell("true")
    return time.perf_counter() - t0


async def again(url: str, key: str, session: str) -> tuple[float, str]:
    """A second call in a live session (reconnecting), timed from connecting, then what
    its egress answered (the proxy's HTTP status for a host it cannot reach: it was reached)."""
    t0 = time.perf_counter()
    async with agents.Agent(url, key, session) as agent:
        await agent.shell("true")
        took = time.perf_counter() - t0
        result = await agent._session.call_tool(
            "shell",
            {"command": "curl -s -o /dev/null -m 20 -w '%{http_code}' http://example.invalid/; true"},
        )
    text = " ".join(getattr(c, "text", "") for c in result.content)
    code = re.search(r"\b([0-5]\d\d)\b", text)
    return took, code.group(1) if code else f"no answer: {text[:80]!r}"


async def waves(jobs: list, size: int) -> list:
    results: list = []
    for start in range(0, len(jobs), size):
        results += await asyncio.gather(*(j() for j in jobs[start : start + size]), return_exceptions=True)
    return results


def metric(text: str, name: str) -> float:
    found = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


async def reaper_metrics(state: Path) -> tuple[float, float]:
    """(sum, count) of the reaper's pass seconds so far."""
    status = json.loads(common_sbx("status", "--json", state=state).stdout or "{}")
    urls = [
        i.get("details", {}).get("metrics")
        for i in status.get("services", [])
        if i.get("service") == "reaper" and i.get("details", {}).get("metrics")
    ]
    if not urls:
        return 0.0, 0.0
    async with httpx2.AsyncClient(timeout=30) as http:
        text = (await http.get(urls[0])).text
    return metric(text, "sbx_reaper_pass_seconds_sum"), metric(text, "sbx_reaper_pass_seconds_count")


def common_sbx(*args: str, state: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SBX_", "NATS_", "SANDBOX_"))}
    return subprocess.run(
        [sys.executable, "-m", "sbx.cli", *args, "--state-dir", str(state)],
        env=env, capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parent.parent,
    )  # fmt: skip


async def console_pages(base: str, key: str) -> dict[str, float]:
    """Seconds each console page took to render (logged in with the API key)."""
    async with httpx2.AsyncClient(base_url=base, timeout=120, follow_redirects=False) as http:
        page = await http.get("/console/login")
        csrf = re.search(r'name="csrf" value="([^"]+)"', page.text)
        if csrf is None:
            return {}
        login = await http.post("/console/login", data={"csrf": csrf.group(1), "key": key, "user": "bench"})
        if login.status_code != 303:
            return {}
        out = {}
        for name in ("sessions", "sandboxes", "system"):
            t = time.perf_counter()
            response = await http.get(f"/console/{name}")
            out[name] = time.perf_counter() - t if response.status_code == 200 else float("nan")
        return out


async def idle_report(label: str, proc: subprocess.Popen[str], state: Path, base: str, key: str,
                      seconds: float, interval: float, settle: float) -> list[str]:  # fmt: skip
    """What the stack costs with every sandbox idle, as lines to print."""
    await asyncio.sleep(settle)  # the pool's refill and the executor's helpers closing (idle 60 s)
    reaper0 = await reaper_metrics(state)
    pids = tree(proc.pid)
    before, t0 = common.process_tree_cpu(proc.pid), time.perf_counter()
    await asyncio.sleep(seconds)
    used = common.cpu_delta(before, common.process_tree_cpu(proc.pid))
    wall = time.perf_counter() - t0
    reaper1 = await reaper_metrics(state)
    passes = reaper1[1] - reaper0[1]
    memory = memory_by_name(pids)
    t = time.perf_counter()
    status = common_sbx("status", state=state)
    status_s = time.perf_counter() - t
    pages = await console_pages(base, key)
    lines = [f"\n{label}: idle CPU over {wall:.0f} s (% of one core), memory (RSS, PSS)"]
    for name in sorted(memory, key=lambda n: -used.get(n, 0.0)):
        n, rss, pss = memory[name]
        cpu = used.get(name, 0.0) / wall * 100
        lines.append(f"  {name:<16} x{n:<5} CPU {cpu:6.2f}%  RSS {rss:8.1f} MiB  PSS {pss:8.1f} MiB")
    lines.append(
        f"  reaper pass: {((reaper1[0] - reaper0[0]) / passes * 1000) if passes else float('nan'):.0f} ms "
        f"(mean of {passes:.0f} passes, every {interval:g} s)"
    )
    lines.append(f"  sbx status: {status_s * 1000:.0f} ms (exit {status.returncode})")
    lines.append("  console pages: " + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in pages.items()))
    return lines


def leftovers(state: Path, veths_before: int) -> dict[str, int]:
    needle = os.fsencode(state)
    procs = 0
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                procs += needle in (p / "cmdline").read_bytes()
            except OSError:
                pass
    loops = 0
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        try:
            loops += backing.read_text().startswith(str(state))
        except OSError:
            pass
    veths = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout.count("veth")
    cgroups = sum(
        1 for root in Path("/sys/fs/cgroup").glob("*/sbx*") for d in root.iterdir() if d.is_dir()
    ) if Path("/sys/fs/cgroup").exists() else 0  # fmt: skip
    return {
        "mounts under the state dir": len(mounts.mounts_under(state)),
        "loop devices of its images": loops,
        "processes naming the state dir": procs,
        "host veths (change)": veths - veths_before,
        "sbx cgroups on the host (all users)": cgroups,
    }


class Fleet:
    """The stack under test and what is printed at the end."""

    def __init__(self, proc: subprocess.Popen[str], state: Path, base: str, args: argparse.Namespace) -> None:
        self.proc, self.state, self.base, self.args = proc, state, base, args
        self.url, self.key = f"{base}/mcp", (state / "api-key").read_text().strip()
        self.names = [f"fleet-{i:05d}" for i in range(args.count)]
        self.out: list[str] = []

    def say(self, line: str) -> None:
        self.out.append(line)
        print(line, flush=True)

    async def fill(self) -> None:
        """Sessions in waves, the first shell of each timed, a no-op call after each stretch;
        the idle stack measured at ``--small`` and ``--count``."""
        args = self.args
        async with agents.Agent(self.url, self.key, "noop") as noop_agent:
            await noop_agent.shell("true")
            stretch = max(args.wave, args.count // STRETCHES)
            done, failed = 0, []
            self.say(
                f"first shell while filling (from connecting; {args.wave} at once), vs a no-op tool call"
            )
            t_fill = time.perf_counter()
            for mark in sorted({args.small, args.count}):
                while done < mark:
                    upto = min(mark, (done // stretch + 1) * stretch)
                    batch = self.names[done:upto]
                    jobs = [lambda n=n: first_shell(self.url, self.key, n) for n in batch]
                    got = await waves(jobs, args.wave)
                    ok = [g for g in got if isinstance(g, float)]
                    failed += [repr(g)[:160] for g in got if not isinstance(g, float)]
                    noop = await noop_p(noop_agent)
                    p = common.percentiles(ok) if ok else {"p50": float("nan"), "p99": float("nan")}
                    self.say(
                        f"  {done + 1:>5}-{upto:<5} p50 {p['p50']:7.0f} ms p99 {p['p99']:7.0f} ms "
                        f"(no-op p50 {noop['p50']:.1f} ms p99 {noop['p99']:.1f} ms: ratio p99 "
                        f"{p['p99'] / noop['p99']:.0f}x) {len(ok)}/{len(batch)} ok"
                    )
                    done = upto
                lines = await idle_report(
                    f"{mark} live sessions", self.proc, self.state, self.base, self.key,
                    args.idle_seconds, args.reaper_interval, args.settle,
                )  # fmt: skip
                for line in lines:
                    self.say(line)
            fill_s = time.perf_counter() - t_fill
            self.say(
                f"filled {done} sessions in {fill_s:.0f} s ({done / fill_s:.1f}/s); failed {len(failed)}"
            )
            if failed:
                self.say(f"  the first failure: {failed[0]}")

    async def reach_all(self) -> None:
        t = time.perf_counter()
        got = await waves([lambda n=n: again(self.url, self.key, n) for n in self.names], self.args.wave)
        ok = [g for g in got if isinstance(g, tuple)]
        codes: dict[str, int] = {}
        for _, code in ok:
            codes[code] = codes.get(code, 0) + 1
        p = common.percentiles([s for s, _ in ok]) if ok else {"p50": float("nan"), "p99": float("nan")}
        self.say(
            f"\nsecond call in every session: {len(ok)}/{len(self.names)} answered in "
            f"{time.perf_counter() - t:.0f} s, p50 {p['p50']:.0f} ms p99 {p['p99']:.0f} ms; egress "
            f"answered by the proxy (HTTP status: sandboxes) {codes}"
        )
        failed = [repr(g)[:300] for g in got if not isinstance(g, tuple)]
        if failed:
            self.say(f"  {len(failed)} failed, the first: {failed[0]}")

    def down(self, veths_before: int) -> None:
        t = time.perf_counter()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(900)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        down_s = time.perf_counter() - t
        self.say(
            f"\nsbx down (SIGTERM to sbx up): {down_s:.1f} s; left: {leftovers(self.state, veths_before)}"
        )
        t = time.perf_counter()
        root = Path(__file__).resolve().parent.parent
        subprocess.run([sys.executable, "-c", agents.CLEANUP, str(self.state)], check=False, cwd=root)
        self.say(
            f"sessions' stopped sandboxes deleted afterwards in {time.perf_counter() - t:.1f} s; "
            f"left: {leftovers(self.state, veths_before)}"
        )


async def idle_pool(args: argparse.Namespace) -> None:
    """``--idle-pool N``: no sessions, a warm pool of N idle sandboxes; the stack's idle
    cost with them, for this checkout and (``--root``) another, one after the other."""
    out: list[str] = []
    for root in (args.root, None) if args.root else (None,):
        with tempfile.TemporaryDirectory(prefix="sbx-stack-fleet-") as tmp:
            state = Path(os.path.realpath(tmp)) / "state"
            extra = {"SBX_MAX_RUNNING": str(args.idle_pool + 20), "SBX_POOL_MAX_IDLE": str(args.idle_pool)}
            proc, base = agents.start_stack(state, pool=args.idle_pool, root=root, **extra)
            try:
                await agents.wait_for_pool(state, args.idle_pool)
                key = (state / "api-key").read_text().strip()
                label = f"{args.idle_pool} idle pool sandboxes, the code of {root or 'this checkout'}"
                out += await idle_report(
                    label, proc, state, base, key, args.idle_seconds, args.reaper_interval, args.settle
                )
            finally:
                agents.stop_stack(proc, state)
    print("\n".join(out))


async def main(args: argparse.Namespace) -> None:
    veths_before = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout.count("veth")
    with tempfile.TemporaryDirectory(prefix="sbx-stack-fleet-") as tmp:
        state = Path(os.path.realpath(tmp)) / "state"
        extra = {
            "SBX_MAX_RUNNING": str(args.count + 100),
            "SBX_PAUSE_TIMEOUT": "0",  # idle sandboxes stay running (not frozen) for the figures
            "SBX_IDLE_TIMEOUT": "7200",
            "SBX_MAX_LIFETIME": "7200",
            "SBX_REAPER_INTERVAL": str(args.reaper_interval),
        }
        t = time.perf_counter()
        proc, base = agents.start_stack(state, pool=10, root=args.root, **extra)
        fleet = Fleet(proc, state, base, args)
        fleet.say(
            f"stack fleet: {args.count} sessions, {os.cpu_count()} cores (a shared machine: other work runs)"
        )
        fleet.say(
            f"sbx up: {time.perf_counter() - t:.1f} s" + (f" (the code of {args.root})" if args.root else "")
        )
        try:
            await fleet.fill()
            if not args.no_reach:
                print(
                    "reaching every session again (a second shell each, a request through its proxy)",
                    flush=True,
                )
                await fleet.reach_all()
        finally:
            fleet.down(veths_before)
    print("\n" + "\n".join(fleet.out))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--small", type=int, default=100, help="the smaller fleet measured on the way")
    parser.add_argument("--wave", type=int, default=25, help="sessions connecting at once")
    parser.add_argument("--idle-seconds", type=float, default=20.0)
    parser.add_argument(
        "--settle",
        type=float,
        default=75.0,
        help="seconds left idle before measuring (helpers close after 60)",
    )
    parser.add_argument("--reaper-interval", type=float, default=5.0)
    parser.add_argument("--root", type=Path, help="run the stack of another checkout (a before)")
    parser.add_argument("--no-reach", action="store_true", help="skip reaching every session again")
    parser.add_argument(
        "--idle-pool", type=int, default=0, help="only an idle pool of this many (see idle_pool)"
    )
    args = parser.parse_args()
    args.small = min(args.small, args.count)
    asyncio.run(idle_pool(args) if args.idle_pool else main(args))
