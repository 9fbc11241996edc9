"""The `shell` round trip of this tree against another version's code (e.g. the commit a
branch started from), in the same run: a `sbx up` of each, one live session on each, and
the calls alternated between them so that both see the same machine.

Prints, per version, p50/p99 of: a no-op MCP tool call (refused by the gateway before any
work), `shell` of `true`, and `shell` of a 100-line script; and each shell figure's
ratio to that version's no-op call (the figure to compare: it cancels the machine's load).
Figures only; nothing is asserted.

    git worktree add --detach /tmp/base <commit>
    .venv/bin/python bench/shell_roundtrip.py --base /tmp/base [--calls 200]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common
from bench.agents import Agent, start_stack, stop_stack, timed

SCRIPT = "\n".join(
    [f'v{i}=$(({i} * 3)); [ "$v{i}" -gt 0 ] && printf "%s\\n" "line {i}" >/dev/null' for i in range(1, 100)]
    + ['echo "done $v99"']
)
"""100 lines of assignments, tests and builtins, one line of output."""

MEASURES = ("no-op tool call", "shell `true`", "shell 100-line script")


Samples = dict[str, dict[str, list[float]]]
"""Per version, per measure: seconds."""


async def measure(urls: dict[str, str], keys: dict[str, str], calls: int) -> Samples:
    samples = {name: {m: [] for m in MEASURES} for name in urls}
    async with contextlib.AsyncExitStack() as stack:  # (clients leave in the reverse order)
        agents = {
            name: await stack.enter_async_context(Agent(urls[name], keys[name], f"roundtrip-{i}"))
            for i, name in enumerate(urls)
        }
        for agent in agents.values():
            for _ in range(20):  # warm up: the session's sandbox, shell and relay
                await agent.shell("true")
                await agent.shell(SCRIPT)
        for _ in range(calls):
            for name, agent in agents.items():  # alternated: both see the same machine
                await timed(samples[name]["no-op tool call"], agent.noop_tool())
                await timed(samples[name]["shell `true`"], agent.shell("true"))
                await timed(samples[name]["shell 100-line script"], agent.shell(SCRIPT))
    return samples


def report(samples: Samples) -> None:
    for name, by_measure in samples.items():
        print(f"\n{name}:")
        noop = common.percentiles(by_measure["no-op tool call"])
        for label, values in by_measure.items():
            p = common.percentiles(values)
            ratio = "" if label == "no-op tool call" else f"  ratio p50 {p['p50'] / noop['p50']:.2f}x"
            print(f"  {label:24} p50 {p['p50']:6.2f} ms  p99 {p['p99']:7.2f} ms{ratio}")


async def main(base: Path, calls: int) -> None:
    roots = {"before (--base)": base, "after (this tree)": None}
    procs, urls, keys = {}, {}, {}
    with tempfile.TemporaryDirectory(prefix="sbx-bench-roundtrip-") as tmp:
        try:
            for i, (name, root) in enumerate(roots.items()):
                state = Path(tmp) / f"state{i}"
                procs[name], base_url = start_stack(state, pool=1, root=root)
                urls[name], keys[name] = f"{base_url}/mcp", (state / "api-key").read_text().strip()
            report(await measure(urls, keys, calls))
        finally:
            for i, proc in enumerate(procs.values()):
                stop_stack(proc, Path(tmp) / f"state{i}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, required=True, help="a checkout of the other version")
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    asyncio.run(main(args.base.resolve(), args.calls))
