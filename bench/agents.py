"""Agent-facing latency through the whole product: `sbx up` as a subprocess, the official
MCP client over streamable HTTP, real sandboxes.

Prints, all in the same run:

* new session id → first `shell` result (cold start: no warm pool yet), p50/p99;
* the same with a warm pool, claimed when the agent connects (SBX_CLAIM_ON_CONNECT, the
  default; also timed from connecting) and, on a stack of its own, on the first tool call
  (``off``), with the ratio;
* `shell` round trip of `true` in a live session vs a no-op MCP tool call (a tool call the
  gateway refuses before doing any work) and vs an MCP `ping`, same server, same client,
  interleaved: p50/p99 and the ratios (target: shell at most 2x the no-op tool call);
* the same `true` through NATS directly (executor request) vs bare `bwrap` exec of `true`;
* N concurrent agents each running a few commands: p50/p99 and errors;
* warm new session -> first shell at several offered claim rates (``--rates``, each for
  ``--seconds``, from a full pool): p50/p99, the rate the load generator achieved, and
  the CPU each process of the stack spent per new session (the claim and the pool refill
  it causes; sandboxes' own processes not counted), next to the load generator's own, and
  a no-op tool call timed just before each burst (first shell / no-op: p50 and p99);
* with ``--base DIR`` (a checkout of another version, e.g. ``git worktree add --detach
  /tmp/base <commit>``) the sweep on a stack of each, alternately (``--rounds``), then
  every figure side by side with the ratio after/before.

Figures only; nothing is asserted.

    .venv/bin/python bench/agents.py [--cold 20] [--warm 200] [--agents 20] [--rates 10,25,50,100]
    .venv/bin/python bench/agents.py --sweep-only --rates 10,25,40 --base /tmp/base [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx2
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common
from shared.contract import codec, commands, execution, ids, states, subjects
from shared.infrastructure import bus as shared_bus
from shared.infrastructure.settings import bus as bus_config

BARE_BWRAP = [
    "--unshare-all", "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin",
    "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64",
    "--proc", "/proc", "--dev", "/dev", "--", "/bin/true",
]  # fmt: skip


class Agent:
    """One MCP connection (initialized once) for one session."""

    def __init__(self, url: str, key: str, session: str) -> None:
        self.url, self.headers = url, {"Authorization": f"Bearer {key}", "X-Session-Id": session}

    async def __aenter__(self) -> Agent:
        self._http = httpx2.AsyncClient(headers=self.headers, timeout=120)
        self._transport = streamable_http_client(self.url, http_client=self._http)
        read, write = await self._transport.__aenter__()
        self._session = ClientSession(read, write)
        await self._session.__aenter__()
        await self._session.initialize()
        # As an agent does before its model can call anything (and the client then knows
        # the tools' output schemas, so its first call_tool does not list them itself).
        await self._session.list_tools()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._session.__aexit__(None, None, None)
        await self._transport.__aexit__(None, None, None)
        await self._http.aclose()

    async def shell(self, command: str) -> None:
        result = await self._session.call_tool("shell", {"command": command})
        if result.is_error:
            raise RuntimeError(str(result.content))

    async def ping(self) -> None:
        await self._session.send_ping()

    async def noop_tool(self) -> None:
        """A whole tool call that does no work: shell_poll refuses a malformed job id
        before anything leaves the gateway."""
        result = await self._session.call_tool("shell_poll", {"job_id": "x"})
        if not result.is_error:
            raise RuntimeError("expected the malformed job id to be refused")


async def timed(samples: list[float], coro) -> None:
    start = time.perf_counter()
    await coro
    samples.append(time.perf_counter() - start)


def start_stack(
    state: Path, pool: int, root: Path | None = None, **extra: str
) -> tuple[subprocess.Popen[str], str]:
    """`sbx up` of this tree, or of the checkout at ``root`` (another version's code)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SBX_", "NATS_", "SANDBOX_"))}
    env.update({"SBX_LOG_LEVEL": "warning", "SBX_POOL_MIN_IDLE": str(pool), "SBX_MAX_RUNNING": "500"})
    env.update(extra)
    if root is not None:
        env["PYTHONPATH"] = f"{root}:{root}/api:{root}/clients/python"
        # A bare checkout has no proxy environment (scripts/setup makes one): without one
        # its proxies never start, so its sandboxes are never routed and its figures lack
        # that work. This tree's is used then (the proxy's code rarely differs; say so).
        if not (root / "proxy" / ".venv" / "bin" / "sbx-proxy").exists():
            ours = Path(__file__).resolve().parent.parent / "proxy" / ".venv" / "bin" / "sbx-proxy"
            env.setdefault("SBX_PROXY_BIN", str(ours))
            print(f"note: {root} has no proxy environment; its stack runs this tree's proxy", file=sys.stderr)
    proc = subprocess.Popen(
        [sys.executable, "-m", "sbx.cli", "up", "--state-dir", str(state), "--port", "0",
         "--nats-port", str(common.free_port())],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=root,
    )  # fmt: skip
    seen = ""
    while "Stop with Ctrl-C" not in seen:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError("sbx up exited:\n" + seen)
        seen += line
    return proc, re.search(r"REST API\s+(http://\S+)/v1/sessions", seen).group(1)


def stop_stack(proc: subprocess.Popen[str], state: Path) -> None:
    """Stop `sbx up`, then delete the sandboxes it left (they outlive it by design)."""
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)
    subprocess.run([sys.executable, "-c", CLEANUP, str(state)], check=False, cwd=Path(__file__).parent.parent)


CLEANUP = """
import asyncio, sys
from pathlib import Path
from shared.runtime import backends
asyncio.run(backends.purge("local", Path(sys.argv[1])))
"""


async def new_sessions(
    url: str,
    key: str,
    prefix: str,
    n: int,
    rate: float,
    whole: list[float] | None = None,
    starts: list[float] | None = None,
) -> tuple[list[float], float]:
    """n new session ids at ``rate`` per second, each timed to its first shell result
    (from the tool call; ``whole`` gets the time from connecting: initialize, tools/list
    and the call, which is what a claim started on connect overlaps with). Session i is
    due at i/rate from the start; ``starts`` gets when each one really connected (a
    saturated machine falls behind the schedule)."""
    samples: list[float] = []

    async def one(i: int) -> None:
        t0 = time.perf_counter()
        if starts is not None:
            starts.append(t0)
        async with Agent(url, key, f"{prefix}-{i}") as agent:
            await timed(samples, agent.shell("true"))
            if whole is not None:
                whole.append(time.perf_counter() - t0)

    start = time.perf_counter()
    tasks = []
    for i in range(n):
        await asyncio.sleep(max(0.0, start + i / rate - time.perf_counter()))
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)
    return samples, time.perf_counter() - start


async def delete_sessions(base: str, key: str, names: list[str]) -> None:
    """Give the claimed sandboxes back (between measurements, so the pool refills)."""
    limit = asyncio.Semaphore(16)
    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=120) as http:

        async def one(name: str) -> None:
            async with limit:
                (await http.delete(f"{base}/v1/sessions/{name}")).raise_for_status()

        await asyncio.gather(*(one(n) for n in names))


IDLE_WINDOW = 3.0
"""Seconds the idle stack is measured before each burst."""


NOOP_PROBES = 40
"""No-op tool calls timed just before each burst (the yardstick of its first shells)."""


async def rate_sweep(
    proc: subprocess.Popen[str],
    base: str,
    key: str,
    state: Path,
    pool: int,
    rates: list[float],
    seconds: float,
) -> tuple[list[str], dict[float, dict[str, float]]]:
    """Warm first shells at each offered rate, each burst from a full pool, next to a
    no-op tool call timed just before it. The CPU of the stack's processes is read before
    the burst and after the pool has refilled, less what the idle stack uses in as long
    (measured just before). Also returns, by rate, the figures (ms) for a side-by-side table."""
    lines: list[str] = []
    figures: dict[float, dict[str, float]] = {}
    async with PoolWatch(state) as watch, Agent(f"{base}/mcp", key, "noop-probe") as probe:
        for rate in rates:
            n = max(10, round(rate * seconds))
            await watch.wait(pool)
            noop: list[float] = []
            for _ in range(NOOP_PROBES):
                await timed(noop, probe.noop_tool())
            await asyncio.sleep(1.0)
            quiet = common.process_tree_cpu(proc.pid)
            await asyncio.sleep(IDLE_WINDOW)
            before, me, t0 = common.process_tree_cpu(proc.pid), time.process_time(), time.monotonic()
            idle = {name: cpu / IDLE_WINDOW for name, cpu in common.cpu_delta(quiet, before).items()}
            if not lines:
                lines.append(
                    f"stack idle, {pool} pool sandboxes: {sum(idle.values()) * 1000:.0f} ms CPU per second ("
                    + ", ".join(
                        f"{k} {v * 1000:.0f}"
                        for k, v in sorted(idle.items(), key=lambda i: -i[1])
                        if v >= 0.0005
                    )
                    + ")"
                )
            starts: list[float] = []
            samples, elapsed = await new_sessions(f"{base}/mcp", key, f"r{rate:g}", n, rate, starts=starts)
            client = time.process_time() - me
            await watch.wait(pool)
            window = time.monotonic() - t0
            used = common.cpu_delta(before, common.process_tree_cpu(proc.pid))
            used = {name: cpu - idle.get(name, 0.0) * window for name, cpu in used.items()}
            achieved = (n - 1) / (max(starts) - min(starts)) if n > 1 else float("nan")
            first, base_p = common.percentiles(samples), common.percentiles(noop)
            lines.append(common.row(f"offered {rate:g}/s (started {achieved:.0f}/s)", samples, elapsed))
            lines.append(
                f"    no-op tool call just before: p50 {base_p['p50']:.2f} ms  p99 {base_p['p99']:.2f} ms;"
                f" first shell / no-op: p50 {first['p50'] / base_p['p50']:.1f}x (target <= 4x)"
                f"  p99 {first['p99'] / base_p['p99']:.1f}x (target <= 15x)"
            )
            per = sorted(((cpu / n * 1000, name) for name, cpu in used.items()), reverse=True)
            lines.append(
                f"    CPU per new session beyond idle: stack {sum(c for c, _ in per):.0f} ms ("
                + ", ".join(f"{name} {ms:.0f}" for ms, name in per if ms >= 0.5)
                + f"), load generator {client / n * 1000:.0f} ms"
            )
            figures[rate] = {
                "started/s": achieved,
                "first p50": first["p50"],
                "first p99": first["p99"],
                "no-op p50": base_p["p50"],
                "no-op p99": base_p["p99"],
                "stack": sum(c for c, _ in per),
                **{name: ms for ms, name in per},
            }
            await delete_sessions(base, key, [f"r{rate:g}-{i}" for i in range(n)])
    return lines, figures


def side_by_side(runs: dict[str, dict[float, dict[str, float]]]) -> list[str]:
    """One table: each figure of each rate, one column per version (and after/before)."""
    names = list(runs)
    lines = []
    for rate in next(iter(runs.values())):
        rows = [
            f"offered {rate:g}/s"
            + "".join(f"{n:>20}" for n in names)
            + ("   after/before" if len(names) == 2 else "")
        ]
        keys: list[str] = []
        for figures in runs.values():
            keys += [k for k in figures.get(rate, {}) if k not in keys]
        fixed = ["started/s", "first p50", "first p99", "no-op p50", "no-op p99", "stack"]
        rest = sorted(
            (k for k in keys if k not in fixed),
            key=lambda k: -max(r.get(rate, {}).get(k, 0) for r in runs.values()),
        )
        for k in fixed + rest:
            values = [runs[n].get(rate, {}).get(k, 0.0) for n in names]
            if k not in fixed and max(values) < 0.5:
                continue
            unit = "" if k == "started/s" else (" ms" if k.startswith(("first", "no-op")) else " ms CPU")
            ratio = f"   {values[1] / values[0]:.2f}x" if len(values) == 2 and values[0] else ""
            rows.append(f"  {k + unit:22}" + "".join(f"{v:20.1f}" for v in values) + ratio)
        lines += rows
    return lines


class PoolWatch:
    """Ready pool sandboxes, counted from one watch of the sandboxes bucket kept open for
    the whole run: the load generator's own reads must not be charged to the stack (a
    full snapshot of the bucket every 0.2 s cost nats-server more per new session than
    the claims did)."""

    def __init__(self, state: Path) -> None:
        self.state = state
        self.ready: set[str] = set()
        self._changed = asyncio.Event()

    async def __aenter__(self) -> PoolWatch:
        info = json.loads((self.state / "stack.json").read_text())
        bus_settings = bus_config.BusSettings(
            nats_url=info["nats_url"],
            namespace=info["namespace"],
            nats_token=(self.state / "nats-token").read_text().strip(),
        )
        self._nc = await shared_bus.connect(bus_settings, "bench")
        bucket = subjects.Topology(info["namespace"]).bucket(subjects.SANDBOX)
        kv = await self._nc.jetstream().key_value(bucket)
        self._watcher = await kv.watchall()
        self._task = asyncio.create_task(self._follow())
        return self

    async def _follow(self) -> None:
        async for entry in self._watcher:
            if entry is None or entry.value is None:
                continue
            s = codec.decode_state(entry.value, states.SandboxState)
            if s.pool and s.session_id is None and s.status == "running":
                self.ready.add(entry.key)
            else:
                self.ready.discard(entry.key)
            self._changed.set()

    async def wait(self, size: int) -> None:
        while len(self.ready) < size:
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await self._changed.wait()

    async def __aexit__(self, *exc: object) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task
        with contextlib.suppress(Exception):
            await self._watcher.stop()
        await self._nc.close()


async def wait_for_pool(state: Path, size: int) -> None:
    async with PoolWatch(state) as watch:
        await watch.wait(size)


async def sweeps(
    tmp: Path, pool: int, rates: list[float], seconds: float, other: Path | None, rounds: int
) -> list[str]:
    """The rate sweep on a stack of this tree, and with ``other`` (``--base``) on one of
    that checkout too, alternately, ``rounds`` times each; then the figures side by side
    (means over the rounds)."""
    roots: dict[str, Path | None] = {"this tree": None}
    if other is not None:
        roots = {"before (--base)": other, "after (this tree)": None}
    lines: list[str] = []
    runs: dict[str, list[dict[float, dict[str, float]]]] = {name: [] for name in roots}
    for r in range(rounds):
        for name, root in roots.items():
            state = tmp / f"sweep-{r}-{len(runs[name])}-{'base' if root else 'head'}"
            proc, base = start_stack(state, pool=pool, root=root)
            try:
                sweep, figures = await rate_sweep(
                    proc, base, (state / "api-key").read_text().strip(), state, pool, rates, seconds
                )
            finally:
                stop_stack(proc, state)
            lines += [f"-- {name}, round {r + 1}:", *sweep]
            runs[name].append(figures)
    means = {
        name: {
            rate: {k: statistics.fmean(f[rate].get(k, 0.0) for f in figs) for k in figs[0][rate]}
            for rate in rates
        }
        for name, figs in runs.items()
    }
    return [*lines, f"side by side (means of {rounds} round(s)):", *side_by_side(means)]


async def main(
    cold: int,
    warm: int,
    agents: int,
    pool: int,
    rate: float,
    rates: list[float],
    seconds: float,
    other: Path | None = None,
    rounds: int = 1,
    sweep_only: bool = False,
) -> None:
    results: dict[str, tuple[list[float], float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        if sweep_only:
            big = max(10, *(round(r * seconds) for r in rates))
            sweep = await sweeps(Path(tmp), big, rates, seconds, other, rounds)
            print(
                f"\nwarm new session -> first shell by offered claim rate ({seconds:g} s each, pool {big}):"
            )
            print("\n".join(sweep))
            return
        state = Path(tmp) / "cold"
        proc, base = start_stack(state, pool=0)
        try:
            key = (state / "api-key").read_text().strip()
            results["cold: new session -> first shell"] = await new_sessions(
                f"{base}/mcp", key, "cold", cold, rate
            )
        finally:
            stop_stack(proc, state)
        state = Path(tmp) / "lazy"
        proc, base = start_stack(state, pool=pool, SBX_CLAIM_ON_CONNECT="off")
        try:
            key = (state / "api-key").read_text().strip()
            await wait_for_pool(state, pool)
            results[f"warm, claim on first call (off) @{rate:g}/s"] = await new_sessions(
                f"{base}/mcp", key, "lazy", min(cold, pool), rate
            )
        finally:
            stop_stack(proc, state)
        big = max(10, *(round(r * seconds) for r in rates))
        sweep = await sweeps(Path(tmp), big, rates, seconds, other, rounds)
        state = Path(tmp) / "state"
        proc, base = start_stack(state, pool=pool)
        try:
            key = (state / "api-key").read_text().strip()
            url = f"{base}/mcp"
            await wait_for_pool(state, pool)
            whole: list[float] = []
            results[f"warm: new session -> first shell @{rate:g}/s"] = await new_sessions(
                url, key, "warm", min(cold, pool), rate, whole
            )
            results["... from connecting (initialize, tools/list, call)"] = (
                whole,
                results[f"warm: new session -> first shell @{rate:g}/s"][1],
            )

            async with Agent(url, key, "warm") as agent:
                await agent.shell("true")
                shell_s: list[float] = []
                ping_s: list[float] = []
                noop_s: list[float] = []
                start = time.perf_counter()
                for _ in range(warm):  # interleaved, so all see the same machine conditions
                    await timed(ping_s, agent.ping())
                    await timed(noop_s, agent.noop_tool())
                    await timed(shell_s, agent.shell("true"))
                elapsed = time.perf_counter() - start
                results["MCP ping (no-op round trip)"] = (ping_s, elapsed / 3)
                results["MCP no-op tool call"] = (noop_s, elapsed / 3)
                results["MCP shell `true` (live session)"] = (shell_s, elapsed / 3)

            info = json.loads((state / "stack.json").read_text())
            bus_settings = bus_config.BusSettings(
                nats_url=info["nats_url"],
                namespace=info["namespace"],
                nats_token=(state / "nats-token").read_text().strip(),
            )
            nc = await shared_bus.connect(bus_settings, "bench")
            topology = subjects.Topology(info["namespace"])
            ensured = codec.decode_reply(
                (
                    await nc.request(
                        topology.session_commands,
                        codec.encode(commands.EnsureSession(command_id=ids.new_id(), session_id="warm")),
                        timeout=60,
                    )
                ).data
            )
            sandbox = ensured.session.sandbox_id
            direct: list[float] = []
            start = time.perf_counter()
            for _ in range(warm):
                request = execution.Shell(session_id="warm", sandbox_id=sandbox, command="true")
                await timed(direct, nc.request(topology.exec_requests, codec.encode(request), timeout=60))
            results["NATS executor shell `true`"] = (direct, time.perf_counter() - start)
            await nc.close()

            from shared.runtime.local import runtime as local

            bare: list[float] = []
            start = time.perf_counter()
            for _ in range(warm):
                t0 = time.perf_counter()
                subprocess.run([local.find_bwrap(), *BARE_BWRAP], check=True)
                bare.append(time.perf_counter() - t0)
            results["bare bwrap exec of `true`"] = (bare, time.perf_counter() - start)

            # What this machine charges for a process spawn after a short idle period:
            # first commands in a session pay it (see the first-shell rows).
            for label, gap in (("host spawn of `true`, back to back", 0.0), ("... 0.3 s apart", 0.3)):
                spawn: list[float] = []
                start = time.perf_counter()
                for _ in range(20):
                    t0 = time.perf_counter()
                    subprocess.run(["/bin/true"], check=True)
                    spawn.append(time.perf_counter() - t0)
                    await asyncio.sleep(gap)
                results[label] = (spawn, time.perf_counter() - start)

            many: list[float] = []
            errors = 0

            async def one_agent(n: int) -> None:
                nonlocal errors
                try:
                    async with Agent(url, key, f"many-{n}") as agent:
                        for _ in range(5):
                            await timed(many, agent.shell("echo hi"))
                except Exception:
                    errors += 1

            start = time.perf_counter()
            await asyncio.gather(*(one_agent(n) for n in range(agents)))
            results[f"{agents} concurrent agents x 5 shells"] = (many, time.perf_counter() - start)

            print(f"\nMCP benchmark (local runtime, sbx up, {os.cpu_count()} cores)\n")
            for label, (samples, took) in results.items():
                print(common.row(label, samples, took))
            shell_p = common.percentiles(results["MCP shell `true` (live session)"][0])
            ping_p = common.percentiles(results["MCP ping (no-op round trip)"][0])
            nats_p = common.percentiles(direct)
            bare_p = common.percentiles(bare)
            noop_p = common.percentiles(results["MCP no-op tool call"][0])
            print(
                f"\nshell/no-op tool ratio (target <= 2x): p50 {shell_p['p50'] / noop_p['p50']:.2f}x  "
                f"p99 {shell_p['p99'] / noop_p['p99']:.2f}x"
            )
            print(
                f"shell/ping ratio: p50 {shell_p['p50'] / ping_p['p50']:.2f}x  "
                f"p99 {shell_p['p99'] / ping_p['p99']:.2f}x"
            )
            print(f"NATS shell / bare bwrap ratio: p50 {nats_p['p50'] / bare_p['p50']:.2f}x")
            print(f"concurrent agents: {errors} errors")
            print(
                f"\nwarm new session -> first shell by offered claim rate ({seconds:g} s each, pool {big}):"
            )
            print("\n".join(sweep))
            lazy_p = common.percentiles(results[f"warm, claim on first call (off) @{rate:g}/s"][0])
            on_p = common.percentiles(results[f"warm: new session -> first shell @{rate:g}/s"][0])
            print(
                f"first shell, claim on connect / on first call: p50 {on_p['p50'] / lazy_p['p50']:.2f}x  "
                f"p99 {on_p['p99'] / lazy_p['p99']:.2f}x"
            )
            cold_p = common.percentiles(results["cold: new session -> first shell"][0])
            warm_p = common.percentiles(next(v for k, v in results.items() if k.startswith("warm:"))[0])
            print(
                f"cold/warm first-shell ratio: p50 {cold_p['p50'] / warm_p['p50']:.2f}x  "
                f"p99 {cold_p['p99'] / warm_p['p99']:.2f}x"
            )
        finally:
            stop_stack(proc, state)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cold", type=int, default=20)
    parser.add_argument("--warm", type=int, default=200)
    parser.add_argument("--agents", type=int, default=20)
    parser.add_argument("--pool", type=int, default=20, help="warm pool size (SBX_POOL_MIN_IDLE)")
    parser.add_argument("--rate", type=float, default=10.0, help="new sessions per second")
    parser.add_argument("--rates", default="10,25,50,100", help="offered claim rates of the sweep")
    parser.add_argument("--seconds", type=float, default=2.0, help="how long each rate is offered")
    parser.add_argument("--base", type=Path, help="a checkout of another version: its sweep side by side")
    parser.add_argument("--rounds", type=int, default=1, help="sweeps of each version, alternately")
    parser.add_argument("--sweep-only", action="store_true", help="only the rate sweep")
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    asyncio.run(
        main(
            args.cold,
            args.warm,
            args.agents,
            args.pool,
            args.rate,
            rates,
            args.seconds,
            args.base.resolve() if args.base else None,
            args.rounds,
            args.sweep_only,
        )
    )
