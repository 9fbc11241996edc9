"""Argument rules (shared.contract.checks): one place each, one wording, used by the
gateway, the executor and the host client."""

from __future__ import annotations

import math

import pytest

from sbx_api import errors, hostapi
from shared.contract import checks, execution


@pytest.mark.parametrize(
    ("text", "said"),
    [("", "command is empty"), ("   \n", "command is empty"), ("echo a\0b", "NUL")],
)
def test_a_command_is_not_blank_and_has_no_nul(text: str, said: str) -> None:
    with pytest.raises(errors.InvalidInput, match=said):
        checks.command(text)


def test_a_good_command_comes_back_as_it_is() -> None:
    assert checks.command("ls -la\n") == "ls -la\n"


@pytest.mark.parametrize("value", [0, -1, math.nan, math.inf, execution.MAX_TIMEOUT + 1, 1e300])
def test_a_timeout_is_more_than_zero_and_at_most_the_maximum(value: float) -> None:
    with pytest.raises(errors.InvalidInput, match="timeout must be more than 0 and at most 3600 seconds"):
        checks.timeout(value)


def test_a_timeout_error_names_what_was_given() -> None:
    with pytest.raises(errors.InvalidInput, match="^SBX_EXEC_TIMEOUT must"):
        checks.timeout(0, what="SBX_EXEC_TIMEOUT")
    assert checks.timeout(None) is None and checks.timeout(execution.MAX_TIMEOUT) == execution.MAX_TIMEOUT


@pytest.mark.parametrize("value", ["", "0" * 31, "A" * 32, "g" * 32, "0" * 33, "../" + "0" * 29])
def test_a_job_id_is_32_lower_case_hex_characters(value: str) -> None:
    with pytest.raises(errors.InvalidInput, match="is not a job id"):
        checks.job_id(value)


def test_cwd_and_path_share_one_rule_with_their_own_names() -> None:
    with pytest.raises(errors.InvalidInput, match="^cwd must be absolute"):
        checks.path("workspace", what="cwd")
    with pytest.raises(errors.InvalidInput, match="^path must not contain a NUL byte"):
        checks.path("/a\0b")
    assert checks.path("//workspace/./a/../b") == "/workspace/b"


@pytest.mark.parametrize(
    ("body", "said"),
    [
        (hostapi.RunBody(command=""), "command is empty"),
        (hostapi.RunBody(command="true", cwd="rel"), "cwd must be absolute"),
        (hostapi.RunBody(command="true", env={"A-B": "x"}), "not a variable name"),
        (hostapi.RunBody(command="true", unset=["1A"]), "not a variable name"),
        (hostapi.RunBody(command="true", env={"A": "x\0y"}), "NUL"),
        (hostapi.RunBody(command="true", timeout=-1), "timeout"),
        (hostapi.RunBody(command="true", list_root="/etc"), "/workspace"),
        (hostapi.RunBody(command="true", prune=["a/b"]), "single directory name"),
    ],
)
def test_a_run_is_checked_the_same_on_both_sides(body: hostapi.RunBody, said: str) -> None:
    with pytest.raises(errors.InvalidInput, match=said):
        checks.run(body)
    run = execution.Run(
        session_id="s",
        sandbox_id="sb",
        inbox="_INBOX.x",
        stop="stop",
        command=body.command,
        cwd=body.cwd,
        env=body.env,
        unset=body.unset,
        timeout=body.timeout,
        list_root=body.list_root,
        prune=body.prune,
    )
    with pytest.raises(errors.InvalidInput, match=said):
        checks.run(run)
