"""The TypeScript client (clients/typescript, issue 20 item 3) against a real `sbx up`: its
generated types equal what openapi-typescript makes of the document the gateway serves,
and its own tests (node's test runner, on the compiled output) pass against the stack."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests import support
from tests.e2e.stacks import running_stack

pytestmark = [
    pytest.mark.needs_root("the local runtime needs root"),
    pytest.mark.slow,
    pytest.mark.timeout(600),  # (npm ci on a fresh clone; the rest takes seconds)
]
PACKAGE = support.ROOT / "clients" / "typescript"


def npm(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    path = shutil.which("npm")
    assert path, "npm is missing: scripts/setup --dev installs it (apt: nodejs, npm)"
    return subprocess.run(
        [path, *args], cwd=PACKAGE, env={**os.environ, **(env or {})},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def succeeded(done: subprocess.CompletedProcess[str]) -> bool:
    """Whether it succeeded; node's and npm's output are shown when it did not."""
    if done.returncode != 0:
        print(done.stdout[-20_000:], done.stderr[-10_000:], sep="\n")
    return done.returncode == 0


@pytest.fixture(scope="module")
def installed():
    """node_modules as package-lock.json says (npm ci when missing or older than the lock)."""
    installed_lock = PACKAGE / "node_modules" / ".package-lock.json"
    lock = PACKAGE / "package-lock.json"
    if not installed_lock.exists() or installed_lock.stat().st_mtime < lock.stat().st_mtime:
        assert succeeded(npm("ci", "--no-audit", "--no-fund", "--loglevel=error"))


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    state = tmp_path_factory.mktemp("stack")
    with running_stack(state) as (_, url):
        yield {"SBX_URL": url, "SANDBOX_API_KEY": (state / "api-key").read_text().strip()}


def test_generated_types_match_the_served_document(installed, stack):
    """src/openapi.ts is what openapi-typescript makes of /openapi.json now: a contract
    change without `npm run generate` fails here (and, if the client no longer fits it,
    its build fails below)."""
    done = npm("run", "--silent", "generate", "--", "--check", env=stack)
    assert succeeded(done)
    assert "matches" in done.stdout


def test_the_client_passes_its_tests_against_the_stack(installed, stack):
    assert succeeded(npm("test", env=stack))
