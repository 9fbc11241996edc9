"""The product as a newcomer runs it: `sbx up` as a subprocess (embedded nats-server and six
supervised services), driven through REST and the other `sbx` subcommands."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys

import httpx
import pytest

from tests import support
from tests.e2e.stacks import (
    SERVICES,
    alive,
    nats_refuses_without_token,
    sbx,
    status,
    support_wait,
)

pytestmark = pytest.mark.slow


def test_sbx_up_runs_the_whole_product(stack):
    proc, state, url = stack
    key_file = state / "api-key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    auth = {"Authorization": f"Bearer {key_file.read_text().strip()}"}

    # The embedded NATS requires the generated token; its secrets are private files.
    for secret in ("nats-token", "nats.conf"):
        assert stat.S_IMODE((state / secret).stat().st_mode) == 0o600
    info = json.loads((state / "stack.json").read_text())
    assert (state / "nats-token").read_text().strip() not in json.dumps(info)
    assert nats_refuses_without_token(info["nats_url"])

    # Every service reports healthy, with its own pid.
    report = support_wait(lambda: (s := status(state))["rc"] == 0 and s)
    assert {i["service"] for i in report["services"] if i["status"] == "ok"} == SERVICES
    assert report["missing"] == []

    with httpx.Client(base_url=url, timeout=10) as client:
        assert client.get("/v1/sessions").status_code == 401
        created = client.post("/v1/sessions", json={"session_id": "e2e", "org_id": "acme"}, headers=auth)
        assert created.status_code == 201, created.text
        assert client.get("/v1/sessions/e2e", headers=auth).json()["org_id"] == "acme"
        assert client.post("/v1/sessions/e2e/stop", headers=auth).json()["status"] == "stopped"
        assert client.delete("/v1/sessions/e2e", headers=auth).status_code == 204
        assert client.get("/openapi.json").json()["paths"]

    lines = [
        json.loads(line)
        for line in sbx("events", "--json", "--session", "e2e", state=state).stdout.splitlines()
    ]
    assert [line["event"]["type"] for line in lines] == [
        "session.created",
        "session.stopped",
        "session.deleted",
    ]
    assert lines[0]["event"]["meta"]["org_id"] == "acme"
    everything = sbx("events", state=state).stdout
    assert everything.count("instance.started") == 6
    assert auth["Authorization"].split()[1] not in everything

    verify = sbx("replay", "--verify", state=state)
    assert verify.returncode == 0 and "projections match" in verify.stdout

    # A crashed service is restarted by the supervisor.
    before = {i["service"]: i["pid"] for i in report["services"]}
    os.kill(before["scheduler"], signal.SIGKILL)
    after = support_wait(
        lambda: (
            (s := status(state))["rc"] == 0
            and any(
                i["service"] == "scheduler" and i["status"] == "ok" and i["pid"] != before["scheduler"]
                for i in s["services"]
            )
            and s
        ),
        timeout=60,
    )
    assert after
    with httpx.Client(base_url=url, timeout=10) as client:
        assert (
            client.post("/v1/sessions", json={"session_id": "after-crash"}, headers=auth).status_code == 201
        )

    # A second `sbx up` on the same state dir refuses clearly.
    second = sbx("up", "--port", "0", "--nats-port", str(support.free_port()), state=state)
    assert second.returncode == 2 and "already running" in second.stderr

    # SIGTERM stops everything cleanly.
    pids = [i["pid"] for i in status(state)["services"]]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(40) == 0
    assert not (state / "stack.json").exists()
    for pid in pids:
        assert not alive(pid), pid
    assert sbx("status", state=state).returncode == 2


def test_gateway_refuses_to_start_without_a_key():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SBX_", "NATS_", "SANDBOX_"))}
    result = subprocess.run(
        [sys.executable, "-m", "services.gateway"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        cwd=support.ROOT,
    )
    assert result.returncode == 2
    assert "SANDBOX_API_KEY is not set" in result.stderr
    short = subprocess.run(
        [sys.executable, "-m", "services.gateway"],
        env={**env, "SANDBOX_API_KEY": "short"},
        capture_output=True,
        text=True,
        timeout=30,
        cwd=support.ROOT,
    )
    assert short.returncode == 2 and "at least 16" in short.stderr


def test_sbx_up_refuses_a_bad_key_before_starting_anything(tmp_path):
    """A too-short SANDBOX_API_KEY stops `sbx up` with one message and exit 2, before NATS
    or any service starts (it used to start them and restart the gateway in a loop)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SBX_", "NATS_", "SANDBOX_"))}
    result = subprocess.run(
        [sys.executable, "-m", "sbx.cli", "up", "--port", "0", "--nats-port", str(support.free_port()),
         "--state-dir", str(tmp_path)],
        env={**env, "SANDBOX_API_KEY": "short"}, capture_output=True, text=True, timeout=60, cwd=support.ROOT,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "SANDBOX_API_KEY must be at least 16" in result.stderr
    assert "restarting" not in result.stderr
    assert not (tmp_path / "nats").exists(), "NATS never started"


def test_status_without_a_stack_says_how_to_start_one(tmp_path):
    result = sbx("status", state=tmp_path)
    assert result.returncode == 2 and "sbx up" in result.stderr
