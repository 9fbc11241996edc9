"""Bursts of new sessions at once through the whole product (`sbx up`, real sandboxes):
N agents connect at the same moment and each runs its first command, over MCP (the
official client: initialize, tools/list, `shell`) and over REST (`POST
/v1/sessions/{id}/run`, which claims the session's sandbox on its first call).

Prints, per burst size (``--sizes``) and transport, in the same run: how many succeeded,
the first command's p50/p99 from the moment the burst began, and the ratio to a no-op MCP
tool call measured just before the burst on the same stack (an idle live session).
The pool is filled to ``--pool`` before every burst (default: the largest burst), so a
burst of N with a pool of N measures claims, not cold starts; the pool then refills.

Figures only; nothing is asserted.

    .venv/bin/python bench/burst.py [--sizes 10,50,100] [--pool 100] [--root OTHER_CHECKOUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx2

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import agents, common

NOOPS = 50


async def mcp_one(url: str, key: str, session: str, t0: float) -> float:
    async with agents.Agent(url, key, session) as agent:
        await agent.shell("true")
    return time.perf_counter() - t0


async def rest_one(http: httpx2.AsyncClient, base: str, session: str, t0: float) -> float:
    response = await http.post(f"{base}/v1/sessions/{session}/run", json={"command": "true"})
    response.raise_for_status()
    last = json.loads(response.text.strip().splitlines()[-1])
    if last.get("type") != "exit" or last.get("exit_code") != 0:
        raise RuntimeError(f"run of `true` ended with {last}")
    return time.perf_counter() - t0


async def noop_p(url: str, key: str) -> dict[str, float]:
    samples: list[float] = []
    async with agents.Agent(url, key, "noop") as agent:
        await agent.shell("true")
        for _ in range(NOOPS):
            await agents.timed(samples, agent.noop_tool())
    return common.percentiles(samples)


async def burst(base: str, key: str, how: str, n: int) -> tuple[list[float], list[str]]:
    """n new sessions at once; (first-command times of those that succeeded, why the
    others failed)."""
    names = [f"{how}{n}-{i}" for i in range(n)]
    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=120) as http:
        t0 = time.perf_counter()
        if how == "mcp":
            jobs = [mcp_one(f"{base}/mcp", key, name, t0) for name in names]
        else:
            jobs = [rest_one(http, base, name, t0) for name in names]
        results = await asyncio.gather(*jobs, return_exceptions=True)
    ok = [r for r in results if isinstance(r, float)]
    return ok, [repr(r)[:200] for r in results if isinstance(r, BaseException)]


async def main(sizes: list[int], pool: int, rest: bool, root: Path | None) -> None:
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp) / "burst"
        proc, base = agents.start_stack(state, pool=pool, root=root, SBX_MAX_RUNNING=str(max(500, 3 * pool)))
        try:
            key = (state / "api-key").read_text().strip()
            for n in sizes:
                for how in ("mcp", "rest") if rest else ("mcp",):
                    await agents.wait_for_pool(state, pool)
                    await asyncio.sleep(1.0)
                    noop = await noop_p(f"{base}/mcp", key)
                    ok, failed = await burst(base, key, how, n)
                    p = common.percentiles(ok) if ok else {"p50": float("nan"), "p99": float("nan")}
                    lines.append(
                        f"{n:4} at once over {how:4}: {len(ok)}/{n} succeeded, first command from the "
                        f"burst's start p50 {p['p50']:7.1f} ms p99 {p['p99']:7.1f} ms; no-op tool call "
                        f"p50 {noop['p50']:.1f} ms p99 {noop['p99']:.1f} ms; ratio p50 "
                        f"{p['p50'] / noop['p50']:.1f}x p99 {p['p99'] / noop['p99']:.1f}x"
                        + (f"  ({len(failed)} failed, the first: {failed[0]})" if failed else "")
                    )
                    print(lines[-1], flush=True)
                    await agents.delete_sessions(base, key, [f"{how}{n}-{i}" for i in range(n)])
        finally:
            agents.stop_stack(proc, state)
    print(f"\nBursts of new sessions (local runtime, sbx up, pool {pool}, {os.cpu_count()} cores)\n")
    print("\n".join(lines))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,50,100")
    parser.add_argument("--pool", type=int, default=0, help="pool kept before each burst (default: largest)")
    parser.add_argument("--root", type=Path, help="run the stack of another checkout (a before)")
    parser.add_argument("--no-rest", action="store_true", help="MCP bursts only")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    asyncio.run(main(sizes, args.pool or max(sizes), not args.no_rest, args.root))
