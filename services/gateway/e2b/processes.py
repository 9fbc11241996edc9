"""envd's ``process.Process``: Start runs the SDK's ``/bin/bash -l -c CMD`` through the
executor's ``Run`` (the host API's streamed run) and streams its output and exit code."""

from __future__ import annotations

import base64
from collections.abc import AsyncGenerator

import msgspec

from sbx_api import hostapi
from services.gateway import hostapi as host_api
from services.gateway.e2b import calls, connect
from shared.contract import execution, states

DEFAULT_CWD = hostapi.WORKSPACE


class ProcessConfig(msgspec.Struct, frozen=True):
    cmd: str = ""
    args: list[str] = []
    envs: dict[str, str] = {}
    cwd: str | None = None


class StartRequest(msgspec.Struct, frozen=True):
    process: ProcessConfig = ProcessConfig()
    stdin: bool = False
    tag: str | None = None
    pty: dict[str, object] | None = None


class Failure(msgspec.Struct, frozen=True):
    """An executor's error frame, as far as it is shown."""

    message: str = "the command failed"
    retriable: bool = False


def command_of(request: StartRequest) -> str:
    """The shell command the SDK's ``commands.run`` sends (``/bin/bash -l -c CMD``)."""
    config = request.process
    if request.pty is not None:
        raise connect.ConnectError("unimplemented", "PTY sessions are not served by this stack (docs/e2b.md)")
    if config.cmd != "/bin/bash" or len(config.args) != 3 or config.args[:2] != ["-l", "-c"]:
        raise connect.ConnectError(
            "unimplemented", "only '/bin/bash -l -c COMMAND' processes are started here"
        )
    return config.args[2]


def event(kind: str, body: dict[str, object]) -> bytes:
    return connect.message({"event": {kind: body}})


def translate(channel: bytes, data: bytes) -> bytes:
    """One executor frame as a ``StartResponse`` envelope (or end of stream)."""
    if channel in (hostapi.STDOUT, hostapi.STDERR):
        name = "stdout" if channel == hostapi.STDOUT else "stderr"
        return event("data", {name: base64.b64encode(data).decode()})
    if channel == hostapi.END:
        end = msgspec.json.decode(data, type=hostapi.End)
        if end.exit_code is None:
            status = "timed out" if end.timed_out else "killed"
            return event("end", {"exitCode": -1, "exited": False, "status": status, "error": status})
        return event(
            "end", {"exitCode": end.exit_code, "exited": True, "status": f"exit status {end.exit_code}"}
        )
    if channel == hostapi.ERROR:
        failed = msgspec.json.decode(data, type=Failure)
        code = "unavailable" if failed.retriable else "internal"
        return connect.end_stream(connect.ConnectError(code, failed.message))
    if channel == hostapi.KEEPALIVE:
        return event("keepalive", {})
    return b""


class Processes:
    def __init__(self, host: host_api.HostAPI) -> None:
        self.host = host

    async def start(self, session: states.SessionState, raw: bytes) -> AsyncGenerator[bytes, None]:
        request = connect.decode(raw, StartRequest)
        command = command_of(request)
        env = {**session.env, **request.process.envs}
        frames, _ = await calls.stream(
            self.host,
            session,
            lambda **fields: execution.Run(
                command=command, cwd=request.process.cwd or DEFAULT_CWD, env=env, **fields
            ),
        )

        async def events() -> AsyncGenerator[bytes, None]:
            try:
                yield event("start", {"pid": 0})
                async for channel, data in frames:
                    yield translate(channel, data)
            finally:
                await frames.aclose()

        return events()
