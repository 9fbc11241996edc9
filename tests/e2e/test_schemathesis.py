"""The REST API against its own OpenAPI document: schemathesis (every check, every phase:
examples, coverage, fuzzing, stateful) against a real ``sbx up``. No 5xx (see
``schemathesis_hooks.py`` for the one by design), no response off the document, no
schema-valid request refused, no invalid one accepted, no deleted session still there."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests import support
from tests.e2e.stacks import running_stack

pytestmark = pytest.mark.slow

CHECKS = ("--exclude-checks", "not_a_server_error")
"""Every check but one (ours instead: the hooks module). Not ``--checks all``: a check the
command line names wins over the config file's per-operation settings."""
CONFIG = Path(__file__).with_name("schemathesis.toml")

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
                "--config-file", str(CONFIG),
                "run",
                f"{url}/openapi.json",
                *CHECKS,
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
    # An upload's body is printed as escaped bytes: long runs of them would push the
    # failures themselves out of the report.
    report = re.sub(r"((\\x[0-9a-f]{2}){16})(\\x[0-9a-f]{2})+", r"\1…", done.stdout + done.stderr)
    assert done.returncode == 0, report[-12000:]
    assert "API Operations" in report and "Tested: " in report, report[-4000:]


def test_every_check_runs_but_where_the_config_says_not():
    """What the run above is asked for, resolved as schemathesis resolves it: every check
    on every operation and phase, but ``not_a_server_error`` (the hooks' instead) and
    ``use_after_free`` on the timeline (an audit record outlives its session)."""
    import msgspec
    import schemathesis
    from schemathesis.checks import CHECKS as REGISTRY
    from schemathesis.config import SchemathesisConfig

    from services.gateway import openapi

    config = SchemathesisConfig.from_path(str(CONFIG))
    config.projects.override.checks.update(excluded_check_names=[CHECKS[1]])
    document = msgspec.json.decode(msgspec.json.encode(openapi.document("test")))
    schema = schemathesis.openapi.from_dict(document, config=config)
    off: dict[tuple[str, str | None], list[str]] = {}
    for result in schema.get_all_operations():
        operation = result.ok()
        for phase in (None, "examples", "coverage", "fuzzing", "stateful"):
            checks = schema.config.checks_config_for(operation=operation, phase=phase)
            names = [n for n in REGISTRY.get_all_names() if not checks.get_by_name(name=n).enabled]
            if names != ["not_a_server_error"]:
                off[(operation.definition.raw["operationId"], phase)] = names
    phases = (None, "examples", "coverage", "fuzzing", "stateful")
    assert off == {("getTimeline", p): ["not_a_server_error", "use_after_free"] for p in phases}
