"""The E2B SDK against one `sbx up`, side by side in the same run and the same sandbox:

* ``commands.run("true")`` (a job of the session followed to its end) against the host
  API's streamed run of ``true``, alternately (``POST /v1/sessions/{id}/run``, the executor's one-off
  ``Run``: what a foreground E2B command was before it became a job), and the ratio;
* ``files.write`` + ``files.read`` of 1 KiB and of 1 MiB, ``files.get_info``,
  ``files.list``;
* a background command started, listed and killed.

Needs root (the local runtime). Figures only; nothing is asserted.

    .venv/bin/python bench/e2b_sdk.py [--rounds 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.e2e.stacks import running_stack


def timed(rounds: int, work: Callable[[], object]) -> list[float]:
    work()  # (warm: the first call of each kind is not counted)
    samples = []
    for _ in range(rounds):
        started = time.perf_counter()
        work()
        samples.append(time.perf_counter() - started)
    return samples


def interleaved(
    rounds: int, first: Callable[[], object], second: Callable[[], object]
) -> tuple[list[float], list[float]]:
    """Both, alternately (a busy machine's drift falls on both alike)."""
    first(), second()
    a: list[float] = []
    b: list[float] = []
    for _ in range(rounds):
        for work, samples in ((first, a), (second, b)):
            started = time.perf_counter()
            work()
            samples.append(time.perf_counter() - started)
    return a, b


def show(label: str, samples: list[float]) -> float:
    ordered = sorted(samples)
    p50 = statistics.median(ordered)
    p90 = ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]
    print(f"  {label:<44} p50 {p50 * 1000:7.1f} ms  p90 {p90 * 1000:7.1f} ms  (n={len(ordered)})")
    return p50


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp) / "stack"
        state.mkdir()
        with running_stack(state) as (_, url):
            key = (state / "api-key").read_text().strip()
            os.environ.update(
                E2B_API_URL=f"{url}/e2b", E2B_SANDBOX_URL=f"{url}/e2b/envd", E2B_API_KEY=key,
                E2B_DOMAIN="e2b-cloud.invalid", NO_PROXY="127.0.0.1,localhost",
            )  # fmt: skip
            from e2b import Sandbox

            sandbox = Sandbox.create()
            sid = sandbox.sandbox_id
            host = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60)

            def host_run() -> None:
                answer = host.post(f"/v1/sessions/{sid}/run", json={"command": "true"})
                assert answer.status_code == 200 and '"exit_code":0' in answer.text, answer.text

            print(f"E2B SDK against sbx up, sandbox {sid}, {args.rounds} rounds each")
            job = show(
                "commands.run('true')  (job + follow)",
                timed(args.rounds, lambda: sandbox.commands.run("true")),
            )
            run = show("host API run 'true'   (one-off Run)", timed(args.rounds, host_run))
            print(f"  ratio commands.run / host API run: {job / run:.2f}")
            small, big = b"x" * 1024, os.urandom(1024 * 1024)
            show("files.write 1 KiB", timed(args.rounds, lambda: sandbox.files.write("/tmp/s", small)))
            show("files.read 1 KiB", timed(args.rounds, lambda: sandbox.files.read("/tmp/s", format="bytes")))
            show("files.write 1 MiB", timed(args.rounds, lambda: sandbox.files.write("/tmp/b", big)))
            show("files.read 1 MiB", timed(args.rounds, lambda: sandbox.files.read("/tmp/b", format="bytes")))
            show("files.get_info", timed(args.rounds, lambda: sandbox.files.get_info("/tmp/b")))
            show("files.list /tmp", timed(args.rounds, lambda: sandbox.files.list("/tmp")))

            def background() -> None:
                handle = sandbox.commands.run("sleep 600", background=True)
                assert handle.pid in [p.pid for p in sandbox.commands.list()]
                handle.kill()

            show("run(background) + list + kill", timed(args.rounds, background))
            host.close()
            sandbox.kill()


if __name__ == "__main__":
    main()
