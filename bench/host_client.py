"""The agent-host client end to end: `sbx exec -- true` on a 1k- and a 10k-file tree,
unchanged and with one file changed, against plain `bash -c true` in the same run.

For each tree, against one `sbx up` started here (real sandboxes, real gateway and
executor):

* **library**: `Sandbox.stream("true")` on a kept sandbox, p50/p99, and where the time
  went (scan + upload, run + listing, download + apply);
* **cli**: `sbx exec --session S --keep -- true` as a new process each time (what an
  agent's tool call costs), p50/p99;
* **bash**: `bash -c true` as a new process, p50 (the floor).

Needs root (the local runtime). Figures only; nothing is asserted.

    .venv/bin/python bench/host_client.py [--rounds 30] [--sizes 1000,10000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sbx_client import Sandbox
from tests.e2e.stacks import running_stack


def make_tree(root: Path, files: int) -> None:
    """``files`` small files, 50 per directory, in a git repository."""
    for i in range(files):
        directory = root / f"d{i // 50:04d}"
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f"f{i:05d}.txt").write_text(f"file {i}\n" * 4)
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)


def percentiles(samples: list[float]) -> str:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return f"p50 {statistics.median(ordered) * 1000:7.1f} ms  p99 {p99 * 1000:7.1f} ms"


def bench_tree(files: int, rounds: int, env: dict[str, str], work: Path) -> None:
    root = work / f"tree{files}"
    make_tree(root, files)
    changed = root / "d0000" / "f00000.txt"
    print(f"\n{files} files")

    sb = Sandbox(cwd=root, session=f"bench-lib-{files}", keep=True, env=env)
    first = time.perf_counter()
    sb.stream("true")
    print(f"  library first call (everything goes up)   {(time.perf_counter() - first) * 1000:7.1f} ms")
    for label, touch in (("unchanged", False), ("one file changed", True)):
        totals: list[float] = []
        parts: dict[str, list[float]] = {"up": [], "run": [], "back": []}
        for i in range(rounds):
            if touch:
                changed.write_text(f"changed {i}\n")
            started = time.perf_counter()
            result = sb.stream("true")
            totals.append(time.perf_counter() - started)
            for key, value in result.seconds.items():
                parts[key].append(value)
        share = {k: statistics.median(v) for k, v in parts.items()}
        whole = sum(share.values()) or 1.0
        print(
            f"  library {label:<18} {percentiles(totals)}   "
            + "  ".join(f"{k} {v * 1000:.1f} ms ({v / whole:.0%})" for k, v in share.items())
        )
    sb.release()

    cli_env = {**env, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    session = f"bench-cli-{files}"
    argv = [sys.executable, "-m", "sbx.cli", "exec", "--session", session, "--keep", "--", "true"]
    subprocess.run(argv, cwd=root, env=cli_env, check=True)
    for label, touch in (("unchanged", False), ("one file changed", True)):
        totals = []
        for i in range(rounds):
            if touch:
                changed.write_text(f"cli {i}\n")
            started = time.perf_counter()
            subprocess.run(argv, cwd=root, env=cli_env, check=True)
            totals.append(time.perf_counter() - started)
        print(f"  cli     {label:<18} {percentiles(totals)}")
    subprocess.run([sys.executable, "-m", "sbx.cli", "release", "--session", session], env=cli_env,
                   stdout=subprocess.DEVNULL, check=True)  # fmt: skip

    totals = []
    for _ in range(rounds):
        started = time.perf_counter()
        subprocess.run(["bash", "-c", "true"], check=True)
        totals.append(time.perf_counter() - started)
    print(f"  bash -c true               {percentiles(totals)}")
    totals = []
    for _ in range(rounds):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        totals.append(time.perf_counter() - started)
    print(f"  python -c pass (startup)   {percentiles(totals)}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--sizes", default="1000,10000")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        state = work / "stack"
        state.mkdir()
        with running_stack(state) as (_, url):
            env = {
                "PATH": os.environ["PATH"], "HOME": str(work), "SBX_URL": url,
                "SANDBOX_API_KEY": (state / "api-key").read_text().strip(),
                "SBX_CLIENT_STATE_DIR": str(work / "client"),
            }  # fmt: skip
            for size in (int(s) for s in args.sizes.split(",")):
                bench_tree(size, args.rounds, env, work)


if __name__ == "__main__":
    main()
