"""The product as tests start it: `sbx up` as a subprocess and the `sbx` command line,
with the waits the e2e tests share (fixtures built on them are in conftest.py)."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from shared.contract import ids
from tests import support

SERVICES = {"gateway", "scheduler", "pool-manager", "executor", "reaper", "proxy-scaler"}


def sbx(*args: str, state: Path, **kw) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SBX_", "NATS_", "SANDBOX_"))}
    return subprocess.run(
        [sys.executable, "-m", "sbx.cli", *args, "--state-dir", str(state)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=support.ROOT,
        **kw,
    )


def read_until(proc: subprocess.Popen[str], pattern: str, timeout: float = 60) -> str:
    """Read the process's stdout (on a thread: a pipe read must not block the test) until
    ``pattern`` appears."""
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    seen = ""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            seen += lines.get(timeout=0.2)
        except queue.Empty:
            if proc.poll() is not None:
                break
            continue
        if re.search(pattern, seen):
            return seen
    raise AssertionError(f"never saw {pattern!r}; output so far:\n{seen}")


def status(state: Path) -> dict:
    result = sbx("status", "--json", state=state)
    return {"rc": result.returncode, **json.loads(result.stdout)}


@contextlib.contextmanager
def running_stack(state: Path, **extra: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """A real `sbx up` (its own NATS port, gateway on a free port, ``extra`` settings);
    (process, gateway URL). Stopped and its sandboxes removed afterwards."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SBX_", "NATS_", "SANDBOX_"))} | extra
    proc = subprocess.Popen(
        [sys.executable, "-m", "sbx.cli", "up", "--state-dir", str(state), "--port", "0",
         "--nats-port", str(support.free_port())],
        env=env, cwd=support.ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        banner = read_until(proc, r"Stop with Ctrl-C")
        url = re.search(r"REST API\s+(http://\S+)/v1/sessions", banner).group(1)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(40)
            except subprocess.TimeoutExpired:
                proc.kill()
        remove_sandboxes(state)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def support_wait(check, timeout: float = 30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = check()
        except (ValueError, KeyError):
            value = None
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError("condition not met")


def nats_refuses_without_token(url: str) -> bool:
    import asyncio

    import nats

    async def attempt() -> bool:
        try:
            nc = await nats.connect(url, connect_timeout=2, allow_reconnect=False, max_reconnect_attempts=0)
        except Exception as exc:  # authorization violation
            return "authorization" in str(exc).lower() or "auth" in type(exc).__name__.lower()
        await nc.close()
        return False

    return asyncio.run(attempt())


def remove_sandboxes(state: Path) -> None:
    """Sandboxes and proxies outlive `sbx up` by design; a test removes the ones it made."""
    import asyncio

    from shared.runtime import backends

    asyncio.run(backends.purge("local", state))


def sandbox_root(state: Path, sandbox_id: str) -> Path | None:
    """A running sandbox's root as its init sees it (``/proc/<init>/root``): read from the
    host without a command entering the sandbox (a frozen one too), and without the host
    mounting anything of it (a sandbox's own filesystem is mounted in its namespace only)."""
    return _root_of(state / "sandboxes" / ids.token(sandbox_id))


def sandbox_files(state: Path, path: str) -> list[Path]:
    """``path`` (absolute, inside a sandbox) in every running sandbox of the stack that has it."""
    found = []
    for directory in sorted((state / "sandboxes").glob("*")):
        root = _root_of(directory)
        if root is not None and (root / path.lstrip("/")).exists():
            found.append(root / path.lstrip("/"))
    return found


def _root_of(directory: Path) -> Path | None:
    try:
        pid = json.loads((directory / "state.json").read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return None
    root = Path(f"/proc/{int(pid)}/root")
    return root if root.exists() else None
