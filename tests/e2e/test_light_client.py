"""The light Python client (clients/python, issue 20 item 3) installed alone into a fresh
virtual environment (only its wire contract, api/, and msgspec come with it), then used
against a real `sbx up`:
sessions, streamed runs, files as tar, the host client's Sandbox and the README's example
(clients/python/tests/checks.py, beside the client, run by that environment's Python: nothing of the
server is importable there). The `[cli]` extra gives `sbx-host`, run as an agent would."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import support
from tests.e2e.stacks import running_stack

pytestmark = [pytest.mark.needs_root("the local runtime needs root"), pytest.mark.slow]
CLIENT = support.ROOT / "clients" / "python"
API = support.ROOT / "api"
CHECKS = CLIENT / "tests" / "checks.py"


def uv() -> str:
    return shutil.which("uv") or str(Path(sys.executable).with_name("uv"))


def venv_with(where: Path, *requirements: str) -> Path:
    subprocess.run([uv(), "venv", "-q", "--python", sys.executable, str(where)], check=True, timeout=120)
    python = where / "bin" / "python"
    subprocess.run(
        [uv(), "pip", "install", "-q", "--python", str(python), *requirements],
        check=True, timeout=300, env={**os.environ, "VIRTUAL_ENV": str(where)},
    )  # fmt: skip
    return python


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    state = tmp_path_factory.mktemp("stack")
    with running_stack(state) as (_, url):
        yield url, (state / "api-key").read_text().strip()


@pytest.fixture(scope="module")
def light(tmp_path_factory) -> Path:
    return venv_with(tmp_path_factory.mktemp("light") / "venv", str(API), str(CLIENT))


def client_env(stack, home: Path) -> dict[str, str]:
    url, key = stack
    return {"PATH": os.environ["PATH"], "HOME": str(home), "SBX_URL": url, "SANDBOX_API_KEY": key}


def test_it_installs_alone_with_its_contract_and_msgspec(light, tmp_path):
    frozen = subprocess.run(
        [uv(), "pip", "freeze", "--python", str(light)], capture_output=True, text=True, check=True
    ).stdout
    names = sorted(line.split("==")[0].split(" @ ")[0].lower() for line in frozen.splitlines() if line)
    assert names == ["cloud-agent-sandbox-api", "cloud-agent-sandbox-client", "msgspec"], frozen
    server_side = ("shared", "services", "sbx", "nats", "httpx")
    probe = (
        f"import sbx_client, sys; print(sorted(m for m in sys.modules if m.split('.')[0] in {server_side}))"
    )
    done = subprocess.run([str(light), "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
    server = subprocess.run([str(light), "-c", "import shared"], cwd=tmp_path, capture_output=True, text=True)
    assert server.returncode != 0  # nothing of the server came along


def test_it_works_against_a_live_stack(light, stack, tmp_path):
    done = subprocess.run(
        [str(light), str(CHECKS), str(CLIENT / "README.md")],
        cwd=tmp_path, env=client_env(stack, tmp_path), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.split() == [
        "ok",
        "sessions",
        "ok",
        "runs",
        "ok",
        "files",
        "ok",
        "sandbox",
        "ok",
        "readme",
    ]


def test_the_cli_extra_runs_commands_as_an_agent_does(stack, tmp_path):
    python = venv_with(tmp_path / "venv", str(API), f"{CLIENT}[cli]")
    host = python.with_name("sbx-host")
    code = tmp_path / "work" / "project"
    code.mkdir(parents=True)
    (code / "notes.txt").write_text("synced up\n")
    env = client_env(stack, tmp_path / "work")

    def sbx_host(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(host), *args], cwd=code, env=env, capture_output=True, text=True, timeout=120
        )

    ran = sbx_host(
        "exec", "--session", "cli-1", "--keep", "--", "cat notes.txt; echo back > made.txt; exit 4"
    )
    assert (ran.returncode, ran.stdout) == (4, "synced up\n"), ran.stderr
    assert (code / "made.txt").read_text() == "back\n"
    # Words after the first are the command's, options included (no `--` needed).
    listed = sbx_host("exec", "--session", "cli-1", "--keep", "ls", "-1", "--hide=notes.txt")
    assert (listed.returncode, listed.stdout) == (0, "made.txt\n"), listed.stderr
    assert sbx_host("release", "--session", "cli-1").stdout == "released cli-1\n"
    usage = sbx_host("exec", "--session", "cli-1")
    assert usage.returncode == 2 and "sbx-host exec: no command given" in usage.stderr
    assert sbx_host("exec", "-h").returncode == 0
    unreachable = subprocess.run(
        [str(host), "exec", "--session", "cli-2", "--", "true"], cwd=code,
        env={**env, "SBX_URL": f"http://127.0.0.1:{support.free_port()}"}, capture_output=True, text=True,
    )  # fmt: skip
    assert unreachable.returncode == 75 and "cannot reach the gateway" in unreachable.stderr
    routed = sbx_host("route", "--json", "--", "git push origin HEAD")
    assert '"where": "host"' in routed.stdout
