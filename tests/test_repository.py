"""Repository-level checks: the architecture contracts hold, the code is lint-clean, and
the generated event catalogue matches the types."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from shared.contract import catalogue

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def test_import_contracts_hold():
    """The import-linter contracts in pyproject.toml: the layers, no I/O in the contract and
    the domain, services never import each other, shared imports no service and the CLI no
    service, backends only through shared.runtime.backends."""
    result = subprocess.run(
        [str(BIN / "lint-imports")], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_ruff_is_clean():
    result = subprocess.run(
        [str(BIN / "ruff"), "check", "."], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout


@pytest.mark.timeout(900)  # a cold run (a fresh clone) takes about a minute
def test_the_type_checker_is_clean():
    """mypy over shared/, services/ and sbx/ (the settings in pyproject.toml), and over the
    proxy in its own environment (mitmproxy's types live there)."""
    for args in (
        [],
        ["--python-executable", str(ROOT / "proxy" / ".venv" / "bin" / "python"), "proxy/sbx_proxy"],
    ):
        result = subprocess.run(
            [str(BIN / "mypy"), *args], cwd=ROOT, capture_output=True, text=True, timeout=600
        )
        assert result.returncode == 0, result.stdout + result.stderr


def test_event_catalogue_is_current():
    on_disk = (ROOT / "docs" / "events.md").read_text()
    assert on_disk == catalogue.render(), "regenerate: python -m shared.contract.catalogue > docs/events.md"


def test_every_service_has_an_entry_point():
    for name in ("gateway", "scheduler", "pool_manager", "executor", "reaper", "proxy_scaler"):
        assert (ROOT / "services" / name / "__main__.py").is_file(), name


def test_compose_runs_nats_and_every_service():
    import yaml

    from sbx import stack

    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = compose["services"]
    assert "-js" in services["nats"]["command"]
    for module in stack.SERVICES:
        entry = services[stack.service_name(module)]
        assert entry["command"] == ["python", "-m", f"services.{module}"]
        assert entry["environment"]["NATS_URL"] == "nats://nats:4222"
    assert "SANDBOX_API_KEY:?" in services["gateway"]["environment"]["SANDBOX_API_KEY"]
    assert all(
        "SANDBOX_API_KEY" not in services[s]["environment"] for s in services if s not in ("gateway", "nats")
    )
    dockerfile = (ROOT / compose["x-service"]["build"]["dockerfile"]).read_text()
    assert "COPY services" in dockerfile and "USER 10001" in dockerfile


def test_no_tracked_symlink_leaves_the_checkout():
    """A symlink committed by accident (a worktree's link to another checkout's environment)
    breaks a fresh clone: every tracked symlink is relative and resolves inside the repo."""
    listing = subprocess.run(
        ["git", "ls-files", "-s", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60
    ).stdout.decode()
    links = [entry.split("\t", 1)[1] for entry in listing.split("\0") if entry.startswith("120000 ")]
    for name in links:
        target = (ROOT / name).readlink()
        assert not target.is_absolute(), f"{name} -> {target}"
        assert (ROOT / name).parent.joinpath(target).resolve().is_relative_to(ROOT), name
