"""A session's async jobs beyond start, poll and stop: started with their own directory,
environment, standard input and split output (the options of ``shell_async``), given
input, signalled, listed with their pids. Every job lives in the sandbox
(``scripts.JOBS``), so any executor serves any of them; these are the operations the E2B
processes API is built on, open to every caller of the executor."""

from __future__ import annotations

import re

from sbx_api import errors
from services.executor import output, scripts
from shared.contract import checks, execution, ids
from shared.runtime import api

HELPER_SLACK = 64 * 1024
LIST_BYTES = 8 * 1024 * 1024
"""Most bytes the job listing's script may answer (labels included)."""
NO_JOB, NO_INPUT, ENDED, INPUT_CLOSED, TAKEN, NO_DIRECTORY = 44, 45, 46, 47, 96, 98


def start_args(request: execution.ShellAsync, job: str) -> list[str]:
    """``JOB_START``'s arguments; bad input refused before anything runs (pure)."""
    checks.command(request.command)
    cwd = checks.path(request.cwd, what="cwd") if request.cwd is not None else ""
    if len(request.label.encode()) > execution.LABEL_MAX or "\0" in request.label:
        raise errors.InvalidInput(f"a job's label is at most {execution.LABEL_MAX} bytes, without NUL")
    pairs = [
        f"{checks.env_name(name)}={checks.env_value(name, value)}" for name, value in request.env.items()
    ]
    flags = ("s" if request.stdin else "") + ("e" if request.split else "")
    return [job, cwd, flags or "-", request.label, *pairs]


async def start(runtime: api.Runtime, request: execution.ShellAsync) -> execution.Reply:
    job = checks.job_id(request.job_id) if request.job_id is not None else ids.new_id()
    result, out, err = await runtime.run(
        request.sandbox_id,
        scripts.argv(scripts.JOB_START, *start_args(request, job)),
        stdin=request.command.encode(),
        timeout=scripts.QUICK,
        max_bytes=HELPER_SLACK,
    )
    if result.exit_code == TAKEN:
        raise errors.Conflict(f"there is a job {job} already")
    if result.exit_code == NO_DIRECTORY:
        raise errors.InvalidInput(f"cwd {request.cwd} is not a directory in the sandbox")
    pid = output.text(out).strip()
    if result.exit_code != 0 or not re.fullmatch(r"[0-9]{1,9}", pid):
        raise errors.InfrastructureError(f"could not start the job: {output.text(out + err)[:500]}")
    return execution.Reply(ok=True, job_id=job, status="running", pid=int(pid))


async def give_input(runtime: api.Runtime, request: execution.ShellInput) -> execution.Reply:
    job = checks.job_id(request.job_id)
    if len(request.data) > execution.INPUT_MAX:
        raise errors.InvalidInput(f"at most {execution.INPUT_MAX} bytes of input at once")
    result, out, err = await runtime.run(
        request.sandbox_id,
        scripts.argv(scripts.JOB_INPUT, job, "close" if request.close else "write"),
        stdin=b"" if request.close else request.data,
        timeout=scripts.QUICK,
        max_bytes=HELPER_SLACK,
    )
    match result.exit_code:
        case 0:
            return execution.Reply(ok=True, job_id=job)
        case 44:  # NO_JOB
            raise errors.NotFound(f"no job {job} in this session")
        case 45:  # NO_INPUT
            raise errors.InvalidInput(f"job {job} was started without input (stdin)")
        case 47:  # INPUT_CLOSED
            raise errors.Conflict(f"job {job} takes no more input: it was closed, or the job has ended")
    if result.timed_out:
        raise errors.Timeout(f"job {job} did not read its input within {scripts.QUICK:g} s")
    raise errors.InfrastructureError(f"could not write to job {job}: {output.text(out + err)[:300]}")


async def signal(runtime: api.Runtime, request: execution.ShellSignal) -> execution.Reply:
    job = checks.job_id(request.job_id)
    if request.signal not in ("TERM", "KILL", "INT", "HUP"):
        raise errors.InvalidInput("signal is one of TERM, KILL, INT, HUP")
    result, out, err = await runtime.run(
        request.sandbox_id, scripts.argv(scripts.JOB_SIGNAL, job, request.signal), timeout=scripts.QUICK
    )
    if result.exit_code in (NO_JOB, ENDED):
        raise errors.NotFound(f"no running job {job} in this session")
    if result.exit_code != 0:
        raise errors.InfrastructureError(f"could not signal job {job}: {output.text(out + err)[:300]}")
    return execution.Reply(ok=True, job_id=job)


async def running(runtime: api.Runtime, request: execution.ShellJobs) -> execution.Reply:
    result, out, _ = await runtime.run(
        request.sandbox_id, scripts.argv(scripts.JOB_DETAILS), timeout=scripts.QUICK, max_bytes=LIST_BYTES
    )
    if result.exit_code != 0:
        raise errors.InfrastructureError(f"could not list the jobs (exit code {result.exit_code})")
    return execution.Reply(ok=True, jobs=scripts.parse_jobs(out))
