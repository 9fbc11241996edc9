"""Checks of the E2B SDK before 2.51 (which creates with ``POST /sandboxes`` and connects
with ``POST /sandboxes/{id}/connect``), run by tests/e2e/test_e2b_sdk.py with the Python
of ``.venv-e2b-old`` (only that SDK installed): plain asserts, one line printed per check.
E2B_API_URL, E2B_API_KEY and E2B_SANDBOX_URL name the stack."""

from __future__ import annotations

import asyncio
import importlib.metadata
import os
import sys

from e2b import AsyncSandbox, Sandbox, SandboxQuery, SandboxState

version = importlib.metadata.version("e2b")
assert tuple(int(p) for p in version.split(".")[:2]) < (2, 51), version
print("sdk", version)

sandbox = Sandbox.create(timeout=120, metadata={"sdk": "old"})
info = sandbox.get_info()
assert info.state == SandboxState.RUNNING and info.metadata == {"sdk": "old"}, info
print("create")
found = Sandbox.list(query=SandboxQuery(metadata={"sdk": "old"})).next_items()
assert [s.sandbox_id for s in found] == [sandbox.sandbox_id], found
print("list")
sandbox.set_timeout(300)
assert sandbox.pause() is True
again = Sandbox.connect(sandbox.sandbox_id)
assert again.get_info().state == SandboxState.RUNNING
print("pause and connect")
result = again.commands.run("echo old; echo e >&2")
assert (result.stdout, result.stderr, result.exit_code) == ("old\n", "e\n", 0), result
print("run")
handle = again.commands.run("cat; echo bg", background=True, stdin=True)
assert handle.pid in [p.pid for p in again.commands.list()]
again.commands.send_stdin(handle.pid, "in\n")
again.commands.close_stdin(handle.pid)
assert handle.wait().stdout == "in\nbg\n"
sleeper = again.commands.run("sleep 600", background=True)
assert again.commands.connect(sleeper.pid).pid == sleeper.pid and again.commands.kill(sleeper.pid) is True
print("background")
again.files.write("/tmp/old/a.txt", "old sdk")
again.files.rename("/tmp/old/a.txt", "/tmp/old/b.txt")
assert again.files.read("/tmp/old/b.txt") == "old sdk"
assert [e.name for e in again.files.list("/tmp/old")] == ["b.txt"] and not again.files.exists(
    "/tmp/old/a.txt"
)
print("files")
assert again.kill() is True and Sandbox.kill(sandbox.sandbox_id) is False
print("kill")


async def run_async() -> None:
    made = await AsyncSandbox.create(metadata={"sdk": "old-async"})
    assert (await made.get_info()).metadata == {"sdk": "old-async"}
    assert await made.kill() is True


asyncio.run(run_async())
print("async", flush=True)
# Every check above passed. e2b 2.50's clients leave threads that crashed the interpreter's
# finalisation once in CI (Fatal Python error: PyGILState_Release, exit -6, after
# "async"): this process ends here, without finalisation; the checks are what is tested.
sys.stderr.flush()
os._exit(0)
