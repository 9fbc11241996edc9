"""What an executor call's audit record says (services/executor/records.py)."""

from __future__ import annotations

import pytest

from services.executor import records
from shared.contract import commands, execution

IDS = {"session_id": "task-42", "sandbox_id": "sb-1"}
STREAM = {**IDS, "inbox": "_INBOX.x", "stop": "sbx.exec.stop.x"}


def test_reads_of_a_job_are_not_audited_and_everything_else_is():
    assert not records.acts(execution.ShellPoll(job_id="j1", **IDS))
    assert not records.acts(execution.ShellWait(job_id="j1", **IDS))
    for request in (
        execution.Shell(command="true", **IDS),
        execution.ShellAsync(command="sleep 9", **IDS),
        execution.ShellStop(job_id="j1", **IDS),
        execution.Edit(command="view", path="/workspace/a", **IDS),
        execution.GetFiles(root="/workspace", **STREAM),
    ):
        assert records.acts(request), request


@pytest.mark.parametrize(
    ("request_", "described"),
    [
        (execution.Shell(command="make test", **IDS), ("make test", None, None)),
        (execution.ShellStop(job_id="j7", **IDS), ("stop j7", None, None)),
        (
            execution.Edit(command="create", path="/w/a.py", file_text="é\n", **IDS),
            ("create /w/a.py", "/w/a.py", 3),
        ),
        (
            execution.Edit(command="insert", path="/w/a.py", insert_line=1, insert_text="xy", **IDS),
            ("insert /w/a.py", "/w/a.py", 2),
        ),
        (execution.Edit(command="view", path="/w/a.py", **IDS), ("view /w/a.py", "/w/a.py", None)),
        (
            execution.PutFiles(root="/workspace", delete=["a", "b"], **STREAM),
            ("put into /workspace, 2 deleted", None, None),
        ),
        (execution.GetFiles(root="/workspace", **STREAM), ("get from /workspace", None, None)),
    ],
)
def test_a_record_names_the_command_the_path_and_the_bytes_written(request_, described):
    assert records.described(request_) == described


def test_a_long_command_is_kept_to_its_first_characters():
    what, _, _ = records.described(execution.Shell(command="x" * 10_000, **IDS))
    assert what == "x" * records.AUDIT_COMMAND_MAX


def test_the_outcome_of_a_call():
    shell = execution.Shell(command="true", **IDS)
    started = execution.ShellAsync(command="sleep 9", **IDS)
    cancelled = commands.ErrorInfo("cancelled", "the caller went away")
    assert records.outcome(shell, execution.Reply(ok=True, exit_code=0)) == "ok"
    assert records.outcome(shell, execution.Reply(ok=True, exit_code=1)) == "ok"  # (its code says)
    assert records.outcome(shell, execution.Reply(ok=True, timed_out=True)) == "timeout"
    assert records.outcome(shell, execution.Reply(ok=False, error=cancelled)) == "cancelled"
    assert records.outcome(shell, execution.Reply(ok=False, error=commands.ErrorInfo("x", "y"))) == "error"
    assert records.outcome(started, execution.Reply(ok=True, job_id="j1")) == "started"


def test_a_call_whose_record_was_not_written_is_an_error_that_says_it_ran():
    reply = records.unaudited(execution.Reply(ok=True, exit_code=3, output="secret"), "disk full")
    assert not reply.ok and reply.output == "" and reply.error is not None
    assert reply.error.code == "infrastructure"
    assert "it ran (exit code 3)" in reply.error.message and "disk full" in reply.error.message
