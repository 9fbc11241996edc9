"""The REST API against its own OpenAPI document: schemathesis (every check, every phase:
examples, coverage, fuzzing, stateful) against a real ``sbx up``. No 5xx (see
``schemathesis_hooks.py`` for the one by design), no response off the document, no
schema-valid request refused, no invalid one accepted, no deleted session still there."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import support
from tests.e2e.test_sbx_up import running_stack

pytestmark = pytest.mark.slow

MAX_EXAMPLES = 60
"""Per operation and phase: about 2,000 requests in all, 1-2 minutes here."""


@pytest.mark.timeout(600)
def test_schemathesis_finds_nothing(tmp_path):
    state = tmp_path / "state"
    with running_stack(state) as (_, url):
        key = (state / "api-key").read_text().strip()
        done = subprocess.run(
            [
                str(Path(sys.executable).with_name("schemathesis")),
                "--config-file", str(Path(__file__).with_name("schemathesis.toml")),
                "run",
                f"{url}/openapi.json",
                "--checks", "all",
                "--exclude-checks", "not_a_server_error",  # (ours instead: the hooks module)
                "--header", f"Authorization: Bearer {key}",
                "--max-examples", str(MAX_EXAMPLES),
                "--request-timeout", "60",
                "--no-color",
            ],
            env={
                **os.environ,
                "SCHEMATHESIS_HOOKS": "tests.e2e.schemathesis_hooks",
                "PYTHONPATH": str(support.ROOT),
            },
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=540,
        )  # fmt: skip
    report = done.stdout + done.stderr
    assert done.returncode == 0, report[-12000:]
    assert "API Operations" in report and "Tested: " in report, report[-4000:]
