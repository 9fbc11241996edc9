"""What an agent reads: the server instructions, the parts every tool description shares,
and how results are written back."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from shared.contract import execution, states

SHELL_TIMEOUT = execution.DEFAULT_TIMEOUT
WAIT_TIMEOUT = 30.0
MAX_TIMEOUT = execution.MAX_TIMEOUT
STDIN_NOTE = (
    "By default the job reads nothing (its stdin is empty); with stdin=true its standard input "
    "stays open for shell_input. "
)
STDIN_ARG = (
    "Keep the job's standard input open so shell_input can write to it (default false: the "
    "job reads nothing)."
)

NETWORK = {
    "proxy": (
        "Outbound HTTP(S) goes through a proxy (HTTP_PROXY and HTTPS_PROXY are set), so pip, "
        "npm, apt and git over HTTPS work; credentials the operator configured are added by the "
        "proxy and are never visible in the sandbox. Private and internal addresses are refused."
    ),
    "none": "The sandbox has no network access (loopback only).",
}
"""What the sandboxes can reach, by ``SBX_SANDBOX_EGRESS``: the tool texts say it."""


def instructions(egress: str) -> str:
    """The server instructions for a deployment whose sandboxes have ``egress``."""
    return (
        "Tools to work in a disposable Linux sandbox that belongs to this MCP session (the "
        "X-Session-Id header). The sandbox is created automatically on first use; /workspace is "
        "the working directory and persists between calls until the sandbox is re-provisioned "
        f"(create_sandbox) or cleared (clear_session). {NETWORK[egress]} Use `shell` for quick "
        "commands, `shell_async` + `shell_poll`/`shell_wait`/`shell_stop` for long-running ones, "
        "and `str_replace_based_edit_tool` to view and edit files."
    )


def invalid_arguments(tool: str, problems: Sequence[Mapping[str, Any]]) -> str:
    """A tool call's argument errors (pydantic's ``errors()``), in our words."""
    said = []
    for problem in problems:
        name = ".".join(str(part) for part in problem.get("loc", ())) or "arguments"
        kind = problem.get("type", "")
        if kind == "missing_argument":
            said.append(f"`{name}` is required")
        elif kind == "unexpected_keyword_argument":
            said.append(f"`{name}` is not a parameter of {tool}")
        else:
            shown = repr(problem.get("input"))
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            said.append(f"`{name}`: {problem.get('msg', 'invalid')} (got {shown})")
    detail = "; ".join(said) or "they do not match the tool's parameters"
    return f"Invalid arguments for {tool}: {detail}. Nothing was run; fix them and call again."


SANDBOX_NOTE = "The sandbox is created automatically on first use; /workspace is the working directory."


def _with_newline(text: str) -> str:
    return text if not text or text.endswith("\n") else text + "\n"


def format_shell(reply: execution.Reply, timeout: float) -> str:
    text = _with_newline(reply.output)
    if reply.timed_out:
        text += f"[timed out after {timeout:g} s]\n"
    exit_code = "unknown" if reply.exit_code is None else str(reply.exit_code)
    return text + f"[exit code: {exit_code}]"


def format_job(job_id: str, reply: execution.Reply, *, waited: float | None = None) -> str:
    status = reply.status or "unknown"
    lines = [f"job {job_id}"]
    if status == "running" and waited is not None:
        lines.append(f"status: running (still running after {waited:g} s; wait again, poll, or stop it)")
    else:
        lines.append(f"status: {status}")
    if reply.exit_code is not None:
        lines.append(f"exit code: {reply.exit_code}")
    if reply.output:
        lines.append("output so far:" if status == "running" else "output:")
        return "\n".join(lines) + "\n" + reply.output
    lines.append("output: (none)")
    return "\n".join(lines)


def provisioned(state: states.SessionState | None, image: str | None) -> str:
    sandbox = state.sandbox_id if state is not None else None
    shown_image = (state.image if state is not None else None) or image or "the default image"
    what = f"sandbox {sandbox}" if sandbox else "a new sandbox"
    return (
        f"provisioned {what} from {shown_image} for this session; any previous sandbox and its "
        "/workspace were deleted"
    )


def creating(budget: float) -> str:
    """What ``create_sandbox``'s description says of its wait."""
    return (
        f"The call waits until the new sandbox runs, its image's first pull included (up to "
        f"{budget / 60:.0f} minutes), with progress notifications if you ask for them; if you stop "
        "waiting, the new sandbox still replaces this session's when it is ready."
    )


def still_creating(elapsed: float) -> str:
    """A ``create_sandbox`` progress notification."""
    return f"starting the new sandbox: {elapsed:.0f} s so far (a first pull of its image can take minutes)"


def create_timed_out(budget: float) -> str:
    return (
        f"the new sandbox was not running after {budget / 60:.0f} minutes; it may still start and then "
        "replace this session's sandbox. Check with shell (e.g. cat /etc/os-release) before calling "
        "create_sandbox again."
    )
