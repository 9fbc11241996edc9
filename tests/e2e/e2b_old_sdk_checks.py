"""Checks of the E2B SDK before 2.51 (which creates with ``POST /sandboxes`` and connects
with ``POST /sandboxes/{id}/connect``), run by tests/e2e/test_e2b_sdk.py with the Python
of ``.venv-e2b-old`` (only that SDK installed): plain asserts, one line printed per check.
E2B_API_URL, E2B_API_KEY and E2B_SANDBOX_URL name the stack."""

from __future__ import annotations

import asyncio
import importlib.metadata

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
assert again.kill() is True and Sandbox.kill(sandbox.sandbox_id) is False
print("kill")


async def run_async() -> None:
    made = await AsyncSandbox.create(metadata={"sdk": "old-async"})
    assert (await made.get_info()).metadata == {"sdk": "old-async"}
    assert await made.kill() is True


asyncio.run(run_async())
print("async")
