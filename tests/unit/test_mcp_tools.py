"""The gateway's MCP tools (services.gateway.mcp_tools) against hand-written fakes of the bus clients.

Tools are called through fastmcp's in-memory client; identity headers come from a header
source passed to ``build_mcp``. One test goes through the real streamable-HTTP app, mounted
the way app.py mounts it, to show that real request headers reach the tools.
"""

from __future__ import annotations

import asyncio
import math
import re
from typing import Any

import fastmcp
import httpx2
import msgspec
import pytest
from fastmcp.client.transports import StreamableHttpTransport
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Mount, Route

from sbx_api import errors
from services.gateway import auth, sessions
from services.gateway import mcp as mcp_tools
from services.gateway.mcp import calls, sandbox
from shared.contract import checks, commands, execution, ids, states
from tests import factories

SESSION = "sess-1"
SANDBOX = "sbx-0123"
JOB = "0123456789abcdef0123456789abcdef"
HEADERS = {"x-session-id": SESSION, "x-org-id": "acme", "x-user-id": "alice", "x-request-id": "req-42"}


# ---- fakes ---------------------------------------------------------------------------------------


def _state(sandbox_id: str | None = SANDBOX, image: str | None = None) -> states.SessionState:
    return factories.session_state(
        SESSION,
        image=image,
        sandbox_id=sandbox_id,
    )


class FakeCommands:
    """Records session commands; answers a canned state or raises a canned error."""

    def __init__(
        self,
        state: states.SessionState | None = None,
        error: Exception | None = None,
        answer: asyncio.Event | None = None,
    ) -> None:
        self.sent: list[commands.SessionCommand] = []
        self.timeouts: list[float | None] = []
        self.state = state if state is not None else _state()
        self.error = error
        self.answer = answer
        """Set: the scheduler answers (None: at once)."""

    async def session(
        self, command: commands.SessionCommand, *, timeout: float | None = None
    ) -> states.SessionState | None:
        self.sent.append(command)
        self.timeouts.append(timeout)
        if self.answer is not None:
            await self.answer.wait()
        if self.error is not None:
            raise self.error
        return self.state


class FakeExecutor:
    """Records (request, budget) pairs; answers a canned reply or raises a canned error."""

    def __init__(self, reply: execution.Reply | None = None, error: Exception | None = None) -> None:
        self.sent: list[tuple[execution.AnyRequest, float]] = []
        self.call_ids: list[str] = []
        self.cancelled: list[tuple[str, str]] = []
        self.reply = reply if reply is not None else execution.Reply(ok=True, output="", exit_code=0)
        self.error = error

    async def run(self, request: execution.AnyRequest, *, budget: float, on_progress=None) -> execution.Reply:
        # Every call is named for a cancellation (random outside an MCP request); kept apart.
        assert request.call_id is not None and re.fullmatch(r"[0-9a-f]{32}", request.call_id)
        self.call_ids.append(request.call_id)
        self.sent.append((msgspec.structs.replace(request, call_id=None), budget))
        if self.error is not None:
            raise self.error
        return self.reply

    def cancel(self, session_id: str, call_id: str) -> None:
        self.cancelled.append((session_id, call_id))


class Harness:
    def __init__(
        self,
        *,
        headers: dict[str, str] | None = None,
        commands: FakeCommands | None = None,
        executor: FakeExecutor | None = None,
        job_input: bool = False,
    ) -> None:
        self.headers = dict(HEADERS if headers is None else headers)
        self.commands = commands or FakeCommands()
        self.executor = executor or FakeExecutor()
        self.mcp = mcp_tools.build_mcp(
            self.commands,  # type: ignore[arg-type]
            self.executor,  # type: ignore[arg-type]
            headers=lambda: self.headers,
            job_input=job_input,
        )

    async def call(self, name: str, arguments: dict[str, Any] | None = None) -> fastmcp.client.CallToolResult:
        async with fastmcp.Client(self.mcp) as client:
            return await client.call_tool(name, arguments or {}, raise_on_error=False)

    async def ok(self, name: str, arguments: dict[str, Any] | None = None) -> str:
        result = await self.call(name, arguments)
        assert not result.is_error, _text(result)
        return _text(result)

    async def error(self, name: str, arguments: dict[str, Any] | None = None) -> str:
        result = await self.call(name, arguments)
        assert result.is_error, _text(result)
        return _text(result)

    def nothing_sent(self) -> bool:
        return not self.commands.sent and not self.executor.sent

    def only_request(self) -> tuple[execution.AnyRequest, float]:
        assert len(self.executor.sent) == 1
        return self.executor.sent[0]


def _text(result: fastmcp.client.CallToolResult) -> str:
    assert len(result.content) == 1
    return result.content[0].text  # type: ignore[union-attr]


VALID_CALLS: list[tuple[str, dict[str, Any]]] = [
    ("shell", {"command": "true"}),
    ("shell_async", {"command": "sleep 100"}),
    ("shell_poll", {"job_id": JOB}),
    ("shell_wait", {"job_id": JOB}),
    ("shell_stop", {"job_id": JOB}),
    ("str_replace_based_edit_tool", {"command": "view", "path": "/workspace"}),
    ("create_sandbox", {}),
    ("clear_session", {}),
]


# ---- the tool list -------------------------------------------------------------------------------


async def test_exactly_the_eight_tools_are_listed() -> None:
    async with fastmcp.Client(Harness().mcp) as client:
        tools = await client.list_tools()
    assert sorted(t.name for t in tools) == sorted(mcp_tools.TOOL_NAMES)
    assert len(mcp_tools.TOOL_NAMES) == 8
    assert {name for name, _ in VALID_CALLS} == set(mcp_tools.TOOL_NAMES)
    for tool in tools:
        assert tool.description
        # The session comes only from the header: no tool takes it as an argument.
        assert not {"session_id", "sandbox_id"} & set(tool.input_schema.get("properties", {}))
    by_name = {t.name: t for t in tools}
    assert "/workspace" in by_name["shell"].description
    assert "network" in by_name["shell"].description
    assert "first use" in by_name["shell"].description
    edit_args = by_name["str_replace_based_edit_tool"].input_schema["properties"]
    assert edit_args["command"]["enum"] == ["view", "create", "str_replace", "insert"]


async def test_job_input_is_one_optional_tool_and_argument() -> None:
    """Off (the default): the eight tools as they are, shell_async without stdin. On: a
    shell_input tool, shell_async(stdin=true), and the executor's shell_input requests."""
    async with fastmcp.Client(Harness().mcp) as client:
        plain = {t.name: t for t in await client.list_tools()}
    assert set(plain["shell_async"].input_schema["properties"]) == {"command"}
    on = Harness(job_input=True)
    async with fastmcp.Client(on.mcp) as client:
        tools = {t.name: t for t in await client.list_tools()}
    assert set(tools) == {*mcp_tools.TOOL_NAMES, "shell_input"}
    assert set(tools["shell_async"].input_schema["properties"]) == {"command", "stdin"}
    assert not tools["shell_input"].annotations.readOnlyHint
    for name in mcp_tools.TOOL_NAMES:
        if name != "shell_async":
            assert tools[name].input_schema == plain[name].input_schema, name
    on.executor.reply = execution.Reply(ok=True, job_id=JOB, status="running")
    assert "shell_input" in await on.ok("shell_async", {"command": "cat", "stdin": True})
    assert on.only_request()[0].stdin is True  # type: ignore[union-attr]
    on.executor.sent.clear()
    await on.ok("shell_input", {"job_id": JOB, "input": "yes\n", "close": True})
    sent = [request for request, _ in on.executor.sent]
    assert [type(r) for r in sent] == [execution.ShellInput, execution.ShellInput, execution.ShellPoll]
    assert (sent[0].data, sent[0].close, sent[1].close) == (b"yes\n", False, True)  # type: ignore[union-attr]
    on.executor.sent.clear()
    assert "job" in await on.error("shell_input", {"job_id": "../x"})
    assert not on.executor.sent  # refused before anything was sent


@pytest.mark.parametrize("egress", ["proxy", "none"])
async def test_the_texts_say_what_the_sandboxes_can_reach(egress: str) -> None:
    """The server instructions and the tools that run commands say the deployment's egress
    (a model told there is no network would never try `pip install`), and only those
    tools are open-world, and only with proxy egress."""
    server = mcp_tools.build_mcp(
        FakeCommands(), FakeExecutor(), headers=lambda: {"x-session-id": "s1"}, egress=egress
    )  # type: ignore[arg-type]
    async with fastmcp.Client(server) as client:
        said = client.instructions or ""
        tools = {t.name: t for t in await client.list_tools()}
    texts = [said, *(t.description or "" for t in tools.values())]
    if egress == "proxy":
        assert "HTTPS_PROXY" in said and "pip" in said
        assert not any("no network" in text for text in texts)
    else:
        assert "no network access" in said
        assert not any("HTTPS_PROXY" in text for text in texts)
    for name in ("shell", "shell_async", "create_sandbox"):
        assert mcp_tools.NETWORK[egress] in (tools[name].description or ""), name
    for name, tool in tools.items():
        assert tool.annotations is not None
        open_world = egress == "proxy" and name in ("shell", "shell_async")
        assert tool.annotations.open_world_hint is open_world, name


async def test_unknown_arguments_are_refused() -> None:
    h = Harness()
    await h.error("shell", {"command": "true", "session_id": "someone-else"})
    assert h.nothing_sent()


# ---- identity from headers -----------------------------------------------------------------------


def test_identity_from_headers_reads_all_fields() -> None:
    who = sessions.identity_from_headers(HEADERS)
    assert who == sessions.Identity(
        session_id=SESSION, correlation_id="req-42", org_id="acme", user_id="alice"
    )
    assert who.actor == commands.Actor(via="mcp", org_id="acme", user_id="alice")


def test_identity_without_optional_headers_gets_a_fresh_correlation_id() -> None:
    first = sessions.identity_from_headers({"x-session-id": SESSION})
    second = sessions.identity_from_headers({"x-session-id": SESSION, "x-org-id": "", "x-request-id": ""})
    assert first.org_id is None and first.user_id is None
    assert len(first.correlation_id) == 32 and first.correlation_id != second.correlation_id


@pytest.mark.parametrize(
    ("headers", "message"),
    [
        ({}, "X-Session-Id header is missing"),
        ({"x-session-id": ""}, "X-Session-Id header is missing"),
        ({"x-session-id": "a/b"}, "X-Session-Id header 'a/b' is not allowed"),
        ({"x-session-id": "x" * 129}, "X-Session-Id header is 129 characters long"),
        ({"x-session-id": SESSION, "x-org-id": "o\x00"}, "X-Org-Id header must be printable ASCII"),
        ({"x-session-id": SESSION, "x-user-id": "u" * 257}, "X-User-Id header is longer than 256"),
        ({"x-session-id": SESSION, "x-request-id": "a b"}, "X-Request-Id must be"),
    ],
)
def test_identity_from_headers_rejects_bad_headers(headers: dict[str, str], message: str) -> None:
    with pytest.raises(errors.InvalidInput, match=message.replace("(", r"\(")):
        sessions.identity_from_headers(headers)


@pytest.mark.parametrize(("name", "arguments"), VALID_CALLS)
@pytest.mark.parametrize("session_id", [None, "", "../etc", "spaces are bad"])
async def test_missing_or_invalid_session_header_is_a_tool_error_and_sends_nothing(
    name: str, arguments: dict[str, Any], session_id: str | None
) -> None:
    headers = {} if session_id is None else {"x-session-id": session_id}
    h = Harness(headers=headers)
    message = await h.error(name, arguments)
    assert message.startswith("X-Session-Id header")
    assert "Traceback" not in message
    assert h.nothing_sent()


# ---- shell ---------------------------------------------------------------------------------------


async def test_shell_ensures_the_session_then_runs_in_its_sandbox() -> None:
    h = Harness(executor=FakeExecutor(execution.Reply(ok=True, output="hello\n", exit_code=0)))
    text = await h.ok("shell", {"command": "echo hello"})
    assert text == "hello\n[exit code: 0]"

    [ensure] = h.commands.sent
    assert isinstance(ensure, commands.EnsureSession)
    assert ensure.session_id == SESSION
    assert ensure.correlation_id == "req-42"
    assert ensure.actor == commands.Actor(via="mcp", org_id="acme", user_id="alice")
    assert len(ensure.command_id) == 32

    request, budget = h.only_request()
    assert request == execution.Shell(
        session_id=SESSION,
        sandbox_id=SANDBOX,
        actor=commands.Actor(via="mcp", org_id="acme", user_id="alice"),
        correlation_id="req-42",
        command="echo hello",
        timeout=None,
    )
    assert budget == 120.0


async def test_shell_uses_a_new_command_id_per_call() -> None:
    h = Harness()
    await h.ok("shell", {"command": "true"})
    await h.ok("shell", {"command": "true"})
    first, second = h.commands.sent
    assert first.command_id != second.command_id


async def test_shell_timeout_is_passed_and_is_the_budget() -> None:
    h = Harness()
    await h.ok("shell", {"command": "make", "timeout": 600})
    request, budget = h.only_request()
    assert isinstance(request, execution.Shell) and request.timeout == 600
    assert budget == 600


async def test_shell_reports_timeouts_and_missing_newlines() -> None:
    reply = execution.Reply(ok=True, output="partial", exit_code=None, timed_out=True)
    h = Harness(executor=FakeExecutor(reply))
    text = await h.ok("shell", {"command": "sleep 99", "timeout": 2.5})
    assert text == "partial\n[timed out after 2.5 s]\n[exit code: unknown]"


async def test_shell_with_no_output_shows_only_the_exit_code() -> None:
    h = Harness(executor=FakeExecutor(execution.Reply(ok=True, output="", exit_code=3)))
    assert await h.ok("shell", {"command": "exit 3"}) == "[exit code: 3]"


@pytest.mark.parametrize("command", ["", "   ", "\n\t", "echo a\x00b"])
@pytest.mark.parametrize("name", ["shell", "shell_async"])
async def test_empty_command_is_rejected_before_sending(name: str, command: str) -> None:
    h = Harness()
    message = await h.error(name, {"command": command})
    assert "command" in message
    assert h.nothing_sent()


@pytest.mark.parametrize("timeout", [0, -1, 3600.5, 1e9])
@pytest.mark.parametrize("name", ["shell", "shell_wait"])
async def test_bad_timeout_is_rejected_before_sending(name: str, timeout: float) -> None:
    h = Harness()
    arguments = {"command": "true"} if name == "shell" else {"job_id": JOB}
    message = await h.error(name, {**arguments, "timeout": timeout})
    assert message.startswith("timeout must be more than 0 and at most 3600 seconds")
    assert h.nothing_sent()


async def test_the_largest_timeout_is_accepted() -> None:
    h = Harness()
    await h.ok("shell", {"command": "true", "timeout": 3600})
    assert h.only_request()[1] == 3600


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_timeouts_are_rejected(value: float) -> None:
    with pytest.raises(errors.InvalidInput):
        checks.timeout(value)


# ---- background jobs -----------------------------------------------------------------------------


async def test_shell_async_returns_the_job_id_and_how_to_follow_it() -> None:
    h = Harness(executor=FakeExecutor(execution.Reply(ok=True, job_id=JOB, status="running")))
    text = await h.ok("shell_async", {"command": "sleep 100"})
    assert text.startswith(f"started job {JOB}\n")
    assert f'shell_poll(job_id="{JOB}")' in text
    request, budget = h.only_request()
    assert isinstance(request, execution.ShellAsync)
    assert (request.command, request.sandbox_id, request.session_id) == ("sleep 100", SANDBOX, SESSION)
    assert budget == 30.0
    assert isinstance(h.commands.sent[0], commands.EnsureSession)


async def test_shell_async_without_a_job_id_in_the_reply_is_an_error() -> None:
    h = Harness(executor=FakeExecutor(execution.Reply(ok=True)))
    assert "no job id" in await h.error("shell_async", {"command": "sleep 1"})


@pytest.mark.parametrize(
    "job_id", ["", "abc", JOB.upper(), JOB + "0", JOB[:-1] + "g", f"../{JOB}", f"{JOB[:16]} {JOB[16:]}"]
)
@pytest.mark.parametrize("name", ["shell_poll", "shell_wait", "shell_stop"])
async def test_bad_job_id_is_rejected_before_sending(name: str, job_id: str) -> None:
    h = Harness()
    message = await h.error(name, {"job_id": job_id})
    assert message.startswith("job_id ")
    assert "32 lower-case hex characters" in message
    assert h.nothing_sent()


async def test_shell_poll_of_a_running_job_shows_output_so_far() -> None:
    reply = execution.Reply(ok=True, job_id=JOB, status="running", output="step 1\nstep 2\n")
    h = Harness(executor=FakeExecutor(reply))
    text = await h.ok("shell_poll", {"job_id": JOB})
    assert text == f"job {JOB}\nstatus: running\noutput so far:\nstep 1\nstep 2\n"
    request, budget = h.only_request()
    assert request == execution.ShellPoll(
        session_id=SESSION,
        sandbox_id=SANDBOX,
        actor=commands.Actor(via="mcp", org_id="acme", user_id="alice"),
        correlation_id="req-42",
        job_id=JOB,
    )
    assert budget == 30.0


async def test_shell_wait_of_an_exited_job_shows_its_exit_code() -> None:
    reply = execution.Reply(ok=True, job_id=JOB, status="exited", exit_code=2, output="boom\n")
    h = Harness(executor=FakeExecutor(reply))
    text = await h.ok("shell_wait", {"job_id": JOB, "timeout": 90})
    assert text == f"job {JOB}\nstatus: exited\nexit code: 2\noutput:\nboom\n"
    request, budget = h.only_request()
    assert isinstance(request, execution.ShellWait)
    assert (request.job_id, request.timeout, budget) == (JOB, 90, 90)


async def test_shell_wait_defaults_to_30_seconds_and_says_when_still_running() -> None:
    h = Harness(executor=FakeExecutor(execution.Reply(ok=True, job_id=JOB, status="running", timed_out=True)))
    text = await h.ok("shell_wait", {"job_id": JOB})
    assert "still running after 30 s" in text
    assert "output: (none)" in text
    request, budget = h.only_request()
    assert isinstance(request, execution.ShellWait) and request.timeout is None
    assert budget == 30.0


async def test_shell_stop_returns_the_final_status() -> None:
    reply = execution.Reply(ok=True, job_id=JOB, status="stopped", exit_code=-15, output="bye\n")
    h = Harness(executor=FakeExecutor(reply))
    text = await h.ok("shell_stop", {"job_id": JOB})
    assert text.startswith(f"job {JOB}\nstatus: stopped\nexit code: -15\n")
    request, budget = h.only_request()
    assert isinstance(request, execution.ShellStop) and request.job_id == JOB
    assert budget == 30.0


# ---- the edit tool -------------------------------------------------------------------------------


async def test_edit_returns_the_executor_output_as_is() -> None:
    output = "     1\tprint('hi')\n"
    h = Harness(executor=FakeExecutor(execution.Reply(ok=True, output=output)))
    text = await h.ok(
        "str_replace_based_edit_tool", {"command": "view", "path": "/workspace/a.py", "view_range": [1, -1]}
    )
    assert text == output
    request, budget = h.only_request()
    assert isinstance(request, execution.Edit)
    assert (request.command, request.path, request.view_range) == ("view", "/workspace/a.py", [1, -1])
    assert (request.session_id, request.sandbox_id, budget) == (SESSION, SANDBOX, 30.0)


async def test_insert_accepts_new_str_as_the_inserted_text() -> None:
    h = Harness()
    await h.ok(
        "str_replace_based_edit_tool",
        {"command": "insert", "path": "/workspace/a.py", "insert_line": 0, "new_str": "import os\n"},
    )
    request, _ = h.only_request()
    assert isinstance(request, execution.Edit)
    assert (request.insert_line, request.insert_text, request.new_str) == (0, "import os\n", None)


async def test_insert_prefers_insert_text_over_new_str() -> None:
    h = Harness()
    await h.ok(
        "str_replace_based_edit_tool",
        {"command": "insert", "path": "/w/a", "insert_line": 3, "insert_text": "x", "new_str": "y"},
    )
    request, _ = h.only_request()
    assert isinstance(request, execution.Edit) and request.insert_text == "x"


async def test_str_replace_sends_old_and_new_str() -> None:
    h = Harness()
    await h.ok(
        "str_replace_based_edit_tool",
        {"command": "str_replace", "path": "/workspace/a.py", "old_str": "a = 1", "new_str": "a = 2"},
    )
    request, _ = h.only_request()
    assert isinstance(request, execution.Edit)
    assert (request.old_str, request.new_str, request.file_text) == ("a = 1", "a = 2", None)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"command": "create", "path": "/w/a"}, "Parameter `file_text` is required for command: create"),
        (
            {"command": "str_replace", "path": "/w/a"},
            "Parameter `old_str` is required for command: str_replace",
        ),
        ({"command": "insert", "path": "/w/a", "insert_text": "x"}, "Parameter `insert_line` is required"),
        ({"command": "insert", "path": "/w/a", "insert_line": 1}, "Parameter `insert_text` is required"),
        ({"command": "view", "path": ""}, "path must not be empty"),
        ({"command": "view", "path": "workspace/a.py"}, "must be absolute"),
    ],
)
async def test_edit_arguments_are_checked_before_sending(arguments: dict[str, Any], message: str) -> None:
    h = Harness()
    assert message in await h.error("str_replace_based_edit_tool", arguments)
    assert h.nothing_sent()


async def test_unknown_edit_command_is_refused() -> None:
    h = Harness()
    await h.error("str_replace_based_edit_tool", {"command": "undo_edit", "path": "/w/a"})
    assert h.nothing_sent()


# ---- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "error",
    [
        errors.LimitExceeded("too many running sandboxes (100); retry later"),
        errors.Unavailable("no scheduler is running; retry shortly"),
        errors.Timeout("the scheduler did not answer in time"),
    ],
)
async def test_a_scheduler_error_is_a_tool_error_with_its_message(error: errors.SandboxError) -> None:
    h = Harness(commands=FakeCommands(error=error))
    assert await h.error("shell", {"command": "true"}) == error.message
    assert not h.executor.sent


async def test_an_executor_error_is_a_tool_error_with_its_message() -> None:
    error = errors.NotFound(f"no job {JOB} in this sandbox")
    h = Harness(executor=FakeExecutor(error=error))
    assert await h.error("shell_poll", {"job_id": JOB}) == error.message


async def test_an_edit_error_from_the_executor_keeps_its_message() -> None:
    error = errors.InvalidInput("No replacement was performed, old_str `x` did not appear verbatim in /w/a.")
    h = Harness(executor=FakeExecutor(error=error))
    arguments = {"command": "str_replace", "path": "/w/a", "old_str": "x"}
    assert await h.error("str_replace_based_edit_tool", arguments) == error.message


async def test_a_session_without_a_sandbox_is_a_tool_error() -> None:
    h = Harness(commands=FakeCommands(state=_state(sandbox_id=None)))
    assert "did not assign a sandbox" in await h.error("shell", {"command": "true"})
    assert not h.executor.sent


async def test_unexpected_exceptions_are_masked() -> None:
    h = Harness(executor=FakeExecutor(error=RuntimeError("secret internal detail")))
    message = await h.error("shell", {"command": "true"})
    assert message == "Error calling tool 'shell'"


# ---- create_sandbox and clear_session ------------------------------------------------------------


async def test_create_sandbox_sends_provision_with_the_options() -> None:
    h = Harness(commands=FakeCommands(state=_state(sandbox_id="sbx-new", image="python:3.12")))
    text = await h.ok(
        "create_sandbox",
        {"image": "python:3.12", "use_kata": True, "run_as_root": False, "writable_root": False},
    )
    assert "sbx-new" in text and "python:3.12" in text
    assert "\n" not in text
    [command] = h.commands.sent
    assert isinstance(command, commands.ProvisionSandbox)
    assert (command.session_id, command.image) == (SESSION, "python:3.12")
    assert (command.use_kata, command.run_as_root, command.writable_root) == (True, False, False)
    assert command.correlation_id == "req-42"
    assert command.actor == commands.Actor(via="mcp", org_id="acme", user_id="alice")
    assert not h.executor.sent


async def test_create_sandbox_defaults() -> None:
    h = Harness()
    text = await h.ok("create_sandbox")
    assert SANDBOX in text
    [command] = h.commands.sent
    assert isinstance(command, commands.ProvisionSandbox)
    assert (command.image, command.use_kata, command.run_as_root, command.writable_root) == (
        None,
        False,
        True,
        True,
    )


async def test_create_sandbox_rejects_a_bad_image_before_sending() -> None:
    h = Harness()
    assert "repository names are lower-case" in await h.error("create_sandbox", {"image": "bad image!"})
    assert h.nothing_sent()


async def test_create_sandbox_passes_not_supported_errors_through() -> None:
    error = errors.NotBuiltYet("use_kata is not supported yet by this deployment")
    h = Harness(commands=FakeCommands(error=error))
    assert await h.error("create_sandbox", {"use_kata": True}) == error.message


async def test_create_sandbox_waits_for_a_pull_with_progress_then_answers(monkeypatch) -> None:
    """A new sandbox whose image is being pulled takes minutes: the call waits its own budget
    (not the 5 s of other commands) and says how long it has waited meanwhile."""
    monkeypatch.setattr(calls.Progress, "EVERY", 0.01)
    answer = asyncio.Event()
    h = Harness(commands=FakeCommands(state=_state(sandbox_id="sbx-new", image="big:1"), answer=answer))
    heard: list[str] = []

    async def progress(done: float, total: float | None, message: str | None) -> None:
        heard.append(message or "")
        if len(heard) == 3:
            answer.set()  # the pull is done: the scheduler answers

    async with fastmcp.Client(h.mcp) as client:
        result = await client.call_tool("create_sandbox", {"image": "big:1"}, progress_handler=progress)
    assert not result.is_error and "sbx-new" in _text(result)
    assert h.commands.timeouts == [sandbox.CREATE_BUDGET] and sandbox.CREATE_BUDGET >= 600
    assert len(heard) >= 3 and all(m.startswith("starting the new sandbox: ") for m in heard), heard


async def test_create_sandbox_past_its_budget_says_what_happens_next() -> None:
    said = "the scheduler did not answer in time; retrying with the same Idempotency-Key is safe"
    h = Harness(commands=FakeCommands(error=errors.Timeout(said)))
    text = await h.error("create_sandbox", {"image": "big:1"})
    assert "Idempotency-Key" not in text, "MCP has no such header"
    assert "15 minutes" in text and "replace this session's sandbox" in text


async def test_clear_session_sends_clear() -> None:
    h = Harness()
    text = await h.ok("clear_session")
    assert SESSION in text and "\n" not in text
    [command] = h.commands.sent
    assert isinstance(command, commands.ClearSession)
    assert command.session_id == SESSION
    assert command.correlation_id == "req-42"
    assert command.actor.via == "mcp"
    assert not h.executor.sent


# ---- over HTTP, mounted as app.py mounts it ------------------------------------------------------

API_KEY = "test-key-0123456789abcdef"


async def test_headers_of_a_real_http_request_reach_the_tools() -> None:
    fake_commands, fake_executor = (
        FakeCommands(),
        FakeExecutor(execution.Reply(ok=True, output="hi\n", exit_code=0)),
    )
    mcp_app = mcp_tools.mcp_http_app(mcp_tools.build_mcp(fake_commands, fake_executor))  # type: ignore[arg-type]

    async def healthz(_: Request) -> PlainTextResponse:
        return PlainTextResponse("ok")

    inner = Starlette(routes=[Route("/healthz", healthz), Mount("/", app=mcp_app)], lifespan=mcp_app.lifespan)
    app = auth.BearerAuth(inner, auth.KeyCheck(API_KEY), public=frozenset({"/healthz"}))

    def client_factory(**kwargs: Any) -> httpx2.AsyncClient:
        kwargs.setdefault("timeout", httpx2.Timeout(10.0))
        return httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), **kwargs)

    headers = {"Authorization": f"Bearer {API_KEY}", "X-Session-Id": "http-session", "X-User-Id": "bob"}
    async with inner.router.lifespan_context(inner):
        transport = StreamableHttpTransport(
            "http://gateway/mcp", headers=headers, httpx_client_factory=client_factory
        )
        async with fastmcp.Client(transport) as client:
            result = await client.call_tool("shell", {"command": "echo hi"})
            assert result.content[0].text == "hi\n[exit code: 0]"  # type: ignore[union-attr]
        # Stateless: no MCP session is issued, so any gateway instance can serve the next request.
        assert transport._session_id is None

        async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app)) as plain:
            unauthorized = await plain.post("http://gateway/mcp", json={})
            assert unauthorized.status_code == 401
            assert (await plain.get("http://gateway/healthz")).text == "ok"

    [ensure] = fake_commands.sent
    assert isinstance(ensure, commands.EnsureSession)
    assert ensure.session_id == "http-session"
    assert ensure.actor == commands.Actor(via="mcp", org_id=None, user_id="bob")
    request, _ = fake_executor.sent[0]
    assert (request.session_id, request.sandbox_id) == ("http-session", SANDBOX)


def test_job_ids_from_new_id_are_accepted_by_the_job_tools() -> None:
    assert checks.job_id(ids.new_id())


async def test_tool_calls_are_counted_by_tool_and_outcome() -> None:
    from shared.infrastructure import metrics

    def count(tool: str, outcome: str) -> float:
        return (
            metrics.REGISTRY.get_sample_value("sbx_mcp_tool_calls_total", {"tool": tool, "outcome": outcome})
            or 0.0
        )

    before = count("shell", "ok"), count("shell", "error")
    h = Harness(executor=FakeExecutor(execution.Reply(ok=True, output="", exit_code=0)))
    await h.ok("shell", {"command": "true"})
    await h.error("shell", {"command": "true", "session_id": "someone-else"})
    assert (count("shell", "ok"), count("shell", "error")) == (before[0] + 1, before[1] + 1)
    assert (metrics.REGISTRY.get_sample_value("sbx_mcp_tool_seconds_count", {"tool": "shell"}) or 0) >= 2
