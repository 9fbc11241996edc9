"""How long stopping `sbx up` takes with many sandboxes, and what it leaves behind.

Starts a real `sbx up` (its own state dir and ports) with a warm pool of ``--pool``
sandboxes, gives ``--sessions`` of them to sessions (REST create, then an MCP `shell`
call each), waits until the pool is full again, then sends SIGINT and times:

* the whole stop (SIGINT to exit);
* its part after the services stopped ("stopping sandboxes and proxies" to "stopped
  sandboxes" in the output: the sandboxes' stop or deletion and the proxies);

and then counts what is left: processes naming the state dir, mounts below it.
Figures only; nothing is asserted. Needs root.

    .venv/bin/python bench/stop.py [--pool 50] [--sessions 10]
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
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import free_port  # noqa: E402
from shared.runtime import backends  # noqa: E402
from shared.runtime.local import mounts  # noqa: E402
from tests.e2e.agent import Agent  # noqa: E402


def status(state: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "sbx.cli", "status", "--json", "--state-dir", str(state)],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )  # fmt: skip
    return json.loads(out.stdout) if out.stdout.strip().startswith("{") else {}


def processes_naming(path: Path) -> int:
    root, found = os.path.realpath(path), 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if root.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found += 1
        except OSError:
            pass
    return found


async def main(pool: int, sessions: int) -> None:
    work = Path(tempfile.mkdtemp(prefix="sbx-stop-bench-"))
    state = work / "state"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SBX_", "NATS_", "SANDBOX_"))}
    env.update(SBX_POOL_MIN_IDLE=str(pool), SBX_MAX_RUNNING=str(pool + sessions + 10), SBX_LOG_LEVEL="error")
    proc = subprocess.Popen(
        [sys.executable, "-m", "sbx.cli", "up", "--state-dir", str(state), "--port", "0",
         "--nats-port", str(free_port())],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines: list[tuple[float, str]] = []
    seen = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.monotonic(), line))
            if "Stop with Ctrl-C" in line:
                seen.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        if not seen.wait(120):
            raise SystemExit("sbx up did not come up:\n" + "".join(t for _, t in lines[-20:]))
        url = next(re.search(r"REST API\s+(http://\S+)/v1/sessions", t) for _, t in lines if "REST API" in t)
        assert url is not None
        key = (state / "api-key").read_text().strip()
        filled = time.monotonic()
        while status(state).get("pool_idle", 0) < pool:
            await asyncio.sleep(1)
        print(f"pool of {pool} filled in {time.monotonic() - filled:.1f} s")
        for n in range(sessions):
            ok, text = await Agent(url.group(1), key, f"stop-bench-{n}").call(
                "shell", command="echo x > /workspace/f"
            )
            assert ok, text
        while status(state).get("pool_idle", 0) < pool:
            await asyncio.sleep(1)
        running = status(state).get("sandboxes", {}).get("running", 0)
        print(f"{running} sandboxes running ({sessions} sessions', {pool} idle in the pool)")
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.wait(300)
        ended = time.monotonic()
        marks = {text.strip(): at for at, text in lines if at >= sent}
        begun = next((at for text, at in marks.items() if "stopping sandboxes and proxies" in text), None)
        summary = next((text for text in marks if "session sandbox(es) stopped" in text), "")
        done = marks.get(summary)
        print(f"stop: {ended - sent:.2f} s from SIGINT to exit")
        if begun is not None and done is not None:
            print(
                f"  of which sandboxes and proxies: {done - begun:.2f} s  ({summary.removeprefix('sbx: ')})"
            )
        print(f"left: {processes_naming(state)} processes naming the state dir, "
              f"{len(mounts.mounts_under(state))} mounts below it")  # fmt: skip
    finally:
        if proc.poll() is None:
            proc.kill()
        await backends.purge("local", state)
        await backends.remove_state("local", work)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pool", type=int, default=50)
    parser.add_argument("--sessions", type=int, default=10)
    args = parser.parse_args()
    asyncio.run(main(args.pool, args.sessions))
