"""How soon what an agent does is on its session's timeline, as the console sees it.

A real `sbx up`; one MCP connection for one session; a follower reads the session's
timeline as the console does (``GET /v1/sessions/{id}/timeline?follow=true``, NDJSON).
Each round the agent makes one call that runs a command whose proxied request is
refused (``curl http://169.254.169.254/...``), then one file edit. Printed: from the end
of each call to its entry arriving on the followed timeline, for the command, the edit
and the egress record (collected from the proxy every 0.5 s: expect about half of that
on average, at most 0.5 s plus the collection). Figures only; needs root.

    .venv/bin/python bench/egress.py [--rounds 40]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common
from bench.agents import Agent, start_stack, stop_stack

SESSION = "egress-bench"


class Follower:
    """Arrival time of each timeline entry, by what it shows."""

    def __init__(self) -> None:
        self.arrived: dict[str, float] = {}
        self.egress: list[float] = []
        """One arrival time per proxied connection, in order."""
        self.ready = asyncio.Event()

    async def run(self, url: str, key: str) -> None:
        headers = {"Authorization": f"Bearer {key}"}
        params = {"follow": "true"}
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=None) as http:
            async with http.stream("GET", f"/v1/sessions/{SESSION}/timeline", params=params) as answer:
                self.ready.set()
                async for line in answer.aiter_lines():
                    if not line.strip():
                        continue
                    entry = json.loads(line)
                    now = time.perf_counter()
                    for c in entry.get("connections") or []:
                        self.egress += [now] * c.get("connections", 1)  # (1 is left out)
                    for marker in re.findall(r"m-[0-9]+(?:\.txt)?", entry["summary"]):
                        self.arrived.setdefault(f"{entry['kind']}:{marker}", now)

    async def wait_egress(self, n: int, timeout: float = 10.0) -> float:
        """When the ``n``-th proxied connection (from 0) arrived."""
        deadline = time.perf_counter() + timeout
        while len(self.egress) <= n:
            if time.perf_counter() > deadline:
                raise TimeoutError(f"egress record {n} never arrived")
            await asyncio.sleep(0.005)
        return self.egress[n]

    async def wait(self, name: str, timeout: float = 10.0) -> float:
        deadline = time.perf_counter() + timeout
        while name not in self.arrived:
            if time.perf_counter() > deadline:
                raise TimeoutError(f"{name} never arrived")
            await asyncio.sleep(0.005)
        return self.arrived[name]


async def main(rounds: int) -> None:
    work = Path(tempfile.mkdtemp(prefix="sbx-egress-bench-"))
    state = work / "state"
    proc, url = start_stack(state, 1, SBX_PAUSE_TIMEOUT="0")
    try:
        key = (state / "api-key").read_text().strip()
        delays: dict[str, list[float]] = {"command": [], "edit": [], "egress": []}
        async with Agent(f"{url}/mcp", key, SESSION) as agent:
            await agent.shell("true")  # the session exists: its timeline can be followed
            follower = Follower()
            task = asyncio.create_task(follower.run(url, key))
            await follower.ready.wait()
            started = time.perf_counter()
            for n in range(rounds):
                marker = f"m-{n}"
                # The command's entry shows the marker; the egress record never shows a path:
                # it is matched by count (one refused connection per round).
                await agent.shell(f"curl -sS --max-time 5 http://169.254.169.254/{marker} >/dev/null; true")
                done = time.perf_counter()
                delays["command"].append(await follower.wait(f"command:{marker}") - done)
                delays["egress"].append(await follower.wait_egress(n) - done)
                result = await agent._session.call_tool(
                    "str_replace_based_edit_tool",
                    {"command": "create", "path": f"/workspace/{marker}.txt", "file_text": "x\n"},
                )
                assert not result.is_error, result.content
                done = time.perf_counter()
                delays["edit"].append(await follower.wait(f"edit:{marker}.txt") - done)
            seconds = time.perf_counter() - started
            task.cancel()
        print(f"\nfrom the end of an agent's call to its entry on the followed timeline ({rounds} rounds)")
        for kind, samples in delays.items():
            print(common.row(f"  {kind}", samples, seconds) + f"  max {max(samples) * 1000:7.1f} ms")
    finally:
        stop_stack(proc, state)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    asyncio.run(main(args.rounds))
