"""envd's ``process.Process`` on the executor's jobs: Start starts the SDK's
``/bin/bash -l -c CMD`` as a job (``shell_async`` with its own directory, environment,
stdin and stderr apart; its pid is the job's process group) and follows its output
(``shell_follow``); the job outlives the stream, so a background command keeps running
and ``Connect`` re-attaches to it by pid. List, SendInput, CloseStdin and SendSignal find
the job by its pid among the running ones (``shell_jobs``) and act on it."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
from collections.abc import AsyncGenerator, Callable

import msgspec
from starlette.types import Receive

from sbx_api import errors, hostapi
from services.gateway import hostapi as host_api
from services.gateway.e2b import calls, connect
from shared.contract import execution, ids, states

DEFAULT_CWD = hostapi.WORKSPACE
SIGNALS: dict[str, execution.JobSignal] = {"SIGNAL_SIGTERM": "TERM", "SIGNAL_SIGKILL": "KILL"}


class ProcessConfig(msgspec.Struct, frozen=True, omit_defaults=True):
    cmd: str = ""
    args: list[str] = []
    envs: dict[str, str] = {}
    cwd: str | None = None


class StartRequest(msgspec.Struct, frozen=True):
    process: ProcessConfig = ProcessConfig()
    stdin: bool = False
    tag: str | None = None
    pty: dict[str, object] | None = None


class Selector(msgspec.Struct, frozen=True):
    pid: int | None = None
    tag: str | None = None


class Selected(msgspec.Struct, frozen=True):
    """Connect, CloseStdin, Update and the fields they share with SendInput and SendSignal."""

    process: Selector = Selector()


class Input(msgspec.Struct, frozen=True):
    stdin: bytes | None = None
    pty: bytes | None = None


class SendInputRequest(msgspec.Struct, frozen=True):
    process: Selector = Selector()
    input: Input = Input()


class StreamStart(msgspec.Struct, frozen=True):
    process: Selector = Selector()


class StreamData(msgspec.Struct, frozen=True):
    input: Input = Input()


class StreamInputRequest(msgspec.Struct, frozen=True):
    start: StreamStart | None = None
    data: StreamData | None = None
    keepalive: dict[str, object] | None = None


class SendSignalRequest(msgspec.Struct, frozen=True):
    process: Selector = Selector()
    signal: str = "SIGNAL_UNSPECIFIED"


class Label(msgspec.Struct, frozen=True, omit_defaults=True):
    """What a job started here keeps as its label: the process as the SDK lists it."""

    config: ProcessConfig
    tag: str | None = None


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


def label_of(request: StartRequest) -> str:
    """The job's label (at most ``execution.LABEL_MAX`` bytes: the envs go first if not)."""
    label = msgspec.json.encode(Label(config=request.process, tag=request.tag))
    if len(label) > execution.LABEL_MAX:
        config = msgspec.structs.replace(request.process, envs={})
        label = msgspec.json.encode(Label(config=config, tag=request.tag))[: execution.LABEL_MAX]
    return label.decode(errors="ignore")


def listed(job: execution.JobInfo) -> dict[str, object]:
    """A running job as envd's ``ProcessInfo`` (its label, if it is one of ours)."""
    try:
        label = msgspec.json.decode(job.label, type=Label)
    except (msgspec.ValidationError, msgspec.DecodeError):
        label = Label(config=ProcessConfig(cmd="/bin/sh", args=["-c", "(a job of the stack's own API)"]))
    info: dict[str, object] = {"config": msgspec.to_builtins(label.config), "pid": job.pid}
    if label.tag is not None:
        info["tag"] = label.tag
    return info


def event(kind: str, body: dict[str, object]) -> bytes:
    return connect.message({"event": {kind: body}})


def ended(end: hostapi.End) -> bytes:
    """A job's end (``shell_follow``'s end frame) as envd's ``end`` event."""
    if end.message == "exited" and end.exit_code is not None:
        return event(
            "end", {"exitCode": end.exit_code, "exited": True, "status": f"exit status {end.exit_code}"}
        )
    status = {"stopped": "signal: killed", "lost": "lost", "nojob": "no such process"}.get(
        end.message, "killed"
    )
    return event("end", {"exitCode": -1, "exited": False, "status": status, "error": status})


def translate(channel: bytes, data: bytes) -> bytes:
    """One executor frame as a ``StartResponse``/``ConnectResponse`` envelope."""
    if channel in (hostapi.STDOUT, hostapi.STDERR):
        name = "stdout" if channel == hostapi.STDOUT else "stderr"
        return event("data", {name: base64.b64encode(data).decode()})
    if channel == hostapi.END:
        return ended(msgspec.json.decode(data, type=hostapi.End))
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
        """The job is started and followed at once (its id chosen here): the follow waits in
        the sandbox for the job to be there, and its frames wait until the start answers."""
        request = connect.decode(raw, StartRequest)
        command = command_of(request)
        env = {**session.env, **request.process.envs}
        job_id = ids.new_id()
        starting = asyncio.ensure_future(
            calls.call(
                self.host,
                session,
                lambda **fields: execution.ShellAsync(
                    command=command,
                    job_id=job_id,
                    cwd=request.process.cwd or DEFAULT_CWD,
                    env=env,
                    stdin=request.stdin,
                    split=True,
                    label=label_of(request),
                    **fields,
                ),
            )
        )
        try:
            frames, _ = await calls.stream(
                self.host,
                session,
                lambda **fields: execution.ShellFollow(job_id=job_id, from_start=True, **fields),
            )
        except BaseException:
            starting.cancel()
            with contextlib.suppress(BaseException):
                await starting
            raise
        try:
            started = await starting
        except BaseException:
            await frames.aclose()
            raise
        assert started.pid is not None
        return self.events(frames, started.pid)

    async def connect(self, session: states.SessionState, raw: bytes) -> AsyncGenerator[bytes, None]:
        job = await self.find(session, connect.decode(raw, Selected).process)
        return await self.follow(session, job.job_id, job.pid, from_start=False)

    async def follow(
        self, session: states.SessionState, job_id: str, pid: int, *, from_start: bool
    ) -> AsyncGenerator[bytes, None]:
        frames, _ = await calls.stream(
            self.host,
            session,
            lambda **fields: execution.ShellFollow(job_id=job_id, from_start=from_start, **fields),
        )
        return self.events(frames, pid)

    @staticmethod
    async def events(
        frames: AsyncGenerator[tuple[bytes, bytes], None], pid: int
    ) -> AsyncGenerator[bytes, None]:
        try:
            yield event("start", {"pid": pid})
            async for channel, data in frames:
                yield translate(channel, data)
        finally:
            await frames.aclose()

    async def list_processes(self, session: states.SessionState, raw: bytes) -> dict[str, object]:
        return {"processes": [listed(job) for job in await self.running(session)]}

    async def send_input(self, session: states.SessionState, raw: bytes) -> dict[str, object]:
        request = connect.decode(raw, SendInputRequest)
        if request.input.stdin is None:
            raise connect.ConnectError("unimplemented", "only stdin input is served (no PTY)")
        data = request.input.stdin
        job = await self.find(session, request.process)
        await self._input(session, job, lambda **f: execution.ShellInput(job_id=job.job_id, data=data, **f))
        return {}

    async def stream_input(
        self, session: states.SessionState, receive: Receive
    ) -> AsyncGenerator[bytes, None]:
        """``StreamInput``: a start naming the process, then its input as it comes (each
        chunk one ``shell_input``); answered once the client's stream ends."""
        job: execution.JobInfo | None = None
        async for raw in connect.envelopes(receive):
            message = connect.decode(raw, StreamInputRequest)
            if message.start is not None and job is None:
                job = await self.find(session, message.start.process)
            elif message.data is not None:
                if job is None:
                    raise connect.ConnectError(
                        "invalid_argument", "a StreamInput starts with its start event"
                    )
                data = message.data.input.stdin
                if data is None:
                    raise connect.ConnectError("unimplemented", "only stdin input is served (no PTY)")
                build = functools.partial(execution.ShellInput, job_id=job.job_id, data=data)
                await self._input(session, job, build)

        async def answer() -> AsyncGenerator[bytes, None]:
            yield connect.message({})

        return answer()

    async def close_stdin(self, session: states.SessionState, raw: bytes) -> dict[str, object]:
        job = await self.find(session, connect.decode(raw, Selected).process)
        await self._input(session, job, lambda **f: execution.ShellInput(job_id=job.job_id, close=True, **f))
        return {}

    async def send_signal(self, session: states.SessionState, raw: bytes) -> dict[str, object]:
        request = connect.decode(raw, SendSignalRequest)
        signal = SIGNALS.get(request.signal)
        if signal is None:
            raise connect.ConnectError("invalid_argument", "signal is SIGNAL_SIGTERM or SIGNAL_SIGKILL")
        job = await self.find(session, request.process)
        try:
            await calls.call(
                self.host, session, lambda **f: execution.ShellSignal(job_id=job.job_id, signal=signal, **f)
            )
        except errors.NotFound:
            raise connect.ConnectError("not_found", f"process {job.pid} has ended") from None
        return {}

    async def _input(
        self, session: states.SessionState, job: execution.JobInfo, build: Callable[..., execution.AnyRequest]
    ) -> None:
        try:
            await calls.call(self.host, session, build)
        except errors.Conflict as exc:
            raise connect.ConnectError("failed_precondition", exc.message) from None
        except errors.InvalidInput as exc:
            raise connect.ConnectError("failed_precondition", exc.message) from None

    async def running(self, session: states.SessionState) -> list[execution.JobInfo]:
        reply = await calls.call(self.host, session, lambda **f: execution.ShellJobs(**f))
        return reply.jobs or []

    async def update(self, session: states.SessionState, raw: bytes) -> dict[str, object]:
        """``Update`` resizes a process's PTY; no process here has one (PTY sessions are
        not served), so a running one is ``failed_precondition``, a missing one ``not_found``."""
        job = await self.find(session, connect.decode(raw, Selected).process)
        raise connect.ConnectError(
            "failed_precondition",
            f"process {job.pid} has no PTY to resize: "
            "PTY sessions are not served by this stack (docs/e2b.md)",
        )

    async def find(self, session: states.SessionState, selector: Selector) -> execution.JobInfo:
        """The running job a selector names (by pid, or by the tag it was started with)."""
        for job in await self.running(session):
            if selector.pid is not None and job.pid == selector.pid:
                return job
            if selector.tag is not None and selector.pid is None and listed(job).get("tag") == selector.tag:
                return job
        raise connect.ConnectError("not_found", f"no running process {selector.pid or selector.tag!r}")
