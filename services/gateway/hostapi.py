"""The host API: streamed exec and file transfer for the agent-host client (``sbx exec``,
``sbx_client.Sandbox``). Same API key as the rest; the session is the path's id, and a
call on a session with no sandbox claims one (as the MCP tools do). Wire format:
:mod:`sbx_api.hostapi`.

* ``POST /v1/sessions/{id}/run``: JSON :class:`~sbx_api.hostapi.RunBody`; answers a
  frame stream (``o``/``e`` output as it comes, ``l`` the listing when asked, then ``x``
  or ``!``). ``X-Run-Id`` names the run: ``POST /v1/sessions/{id}/runs/{run}/stop`` (any
  gateway) kills it, and so does the client going away.
* ``POST /v1/sessions/{id}/files/put``: body frames ``j`` (:class:`~sbx_api.hostapi.PutParams`)
  then ``t`` (a tar); answers ``l`` (the tree's listing) and ``x``.
* ``POST /v1/sessions/{id}/files/get``: JSON :class:`~sbx_api.hostapi.GetBody`; answers
  ``t`` (a tar of those paths) and ``x``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import TypeVar

import anyio
import msgspec
import structlog
from nats.aio.client import Client
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute
from starlette.types import Receive, Scope, Send

from sbx_api import errors, hostapi
from services.gateway import media, rest, schemas, sessions
from shared.contract import checks, commands, execution, ids, subjects
from shared.infrastructure import rpc, streams

log = structlog.get_logger(__name__)

FAILED = "hostapi.failed"
"""What a 5xx answer of the host API (and of the archive beside it) is logged as."""

_Body = TypeVar("_Body", bound=msgspec.Struct)
T = TypeVar("T")
KEEPALIVE_FRAME = streams.Frame(hostapi.KEEPALIVE, b"")

BODY_MAX = 16 * 1024 * 1024
"""Largest JSON body (a download's path list)."""
BODY_SILENCE = 60.0
"""An upload that sends nothing for this long is abandoned."""
START_BUDGET = 30.0


_FRAMES = (
    f"A frame stream ({hostapi.MEDIA_TYPE}): 1 channel byte, a 4-byte big-endian length, the "
    "payload; see api/sbx_api/hostapi.py. Ends with an 'x' frame (JSON result) or a '!' frame "
    "(JSON error); 'h' frames (keepalives) are skipped."
)
ERRORS = {
    400: (schemas.Problem, "Invalid input; nothing was run."),
    401: (schemas.Problem, "Missing or wrong API key."),
    409: (
        schemas.Problem,
        "The session has another sandbox than the one named (sandbox_changed); its sandbox "
        "stopped meanwhile (not_running); its image cannot be had (image_unavailable).",
    ),
    429: (
        schemas.Problem,
        "A limit: no sandbox can be started now (retry), or a program in the sandbox wrote "
        "more than the host takes (it was killed).",
    ),
    503: (schemas.Problem, "The scheduler, an executor or NATS is unavailable; retry."),
    504: (schemas.Problem, "The sandbox did not answer in time; retry."),
}
SESSION = rest.Param(
    "session_id",
    "path",
    "The session id (its sandbox is claimed if it has none).",
    rest.SESSION_ID_SCHEMA,
    required=True,
)
OPERATIONS: tuple[rest.Operation, ...] = (
    rest.Operation(
        "POST",
        "/v1/sessions/{session_id}/run",
        "runCommand",
        "Run a command in the session's sandbox, output streamed as it comes",
        "run",
        {
            200: (
                None,
                "The output as it comes, by the Accept header: NDJSON (the default) or "
                "server-sent events, one RunEvent a line or event, the last 'exit' or 'error', "
                "'keepalive' while the command is quiet; or frames for the agent-host client: " + _FRAMES,
            ),
            **ERRORS,
            406: (schemas.Problem, "The Accept header admits none of the answer's media types."),
        },
        body=hostapi.RunBody,
        params=(SESSION, *rest.ATTRIBUTION),
        tag="host",
        answer_media=(
            (hostapi.NDJSON, hostapi.RunEvent),
            (hostapi.EVENT_STREAM, hostapi.RunEvent),
            (hostapi.MEDIA_TYPE, None),
        ),
        answer_headers=("X-Sandbox-Id", "X-Run-Id"),
    ),
    rest.Operation(
        "POST",
        "/v1/sessions/{session_id}/runs/{run_id}/stop",
        "stopRun",
        "Stop a running command (its processes are killed); any gateway instance can",
        "stop",
        {202: (None, "Asked to stop."), **ERRORS},
        params=(
            SESSION,
            rest.Param(
                "run_id", "path", "The run's X-Run-Id.", {"type": "string", "pattern": "^[0-9a-f]{32}$"}, True
            ),
        ),
        tag="host",
    ),
    rest.Operation(
        "POST",
        "/v1/sessions/{session_id}/files/put",
        "putFiles",
        "Upload: the body is frames, a 'j' frame of PutParams JSON then 't' frames of a tar",
        "put",
        {200: (None, _FRAMES + " 'l' frames: the tree's listing after the upload."), **ERRORS},
        params=(SESSION, *rest.ATTRIBUTION),
        tag="host",
        body_media_type=hostapi.MEDIA_TYPE,
        answer_media=((hostapi.MEDIA_TYPE, None),),
        answer_headers=("X-Sandbox-Id", "X-Run-Id"),
    ),
    rest.Operation(
        "POST",
        "/v1/sessions/{session_id}/files/get",
        "getFiles",
        "Download the named paths as a tar",
        "get",
        {200: (None, _FRAMES + " 't' frames: a tar of the paths."), **ERRORS},
        body=hostapi.GetBody,
        params=(SESSION, *rest.ATTRIBUTION),
        tag="host",
        answer_media=((hostapi.MEDIA_TYPE, None),),
        answer_headers=("X-Sandbox-Id", "X-Run-Id"),
    ),
)


class LiveStream(Response):
    """A streamed answer that also watches for the client going away (whatever the ASGI
    server's version): then the stream's generator is closed, which stops the work."""

    def __init__(self, chunks: AsyncGenerator[bytes, None], headers: dict[str, str], media_type: str) -> None:
        # Like StreamingResponse: no body attribute, so no Content-Length.
        self.status_code = 200
        self.background = None
        self.media_type = media_type
        self.init_headers(headers)
        self.chunks = chunks

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def stream() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for data in self.chunks:
                if data:
                    await send({"type": "http.response.body", "body": data, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def disconnect() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        try:
            async with anyio.create_task_group() as group:

                async def first(work: Callable[[], Awaitable[None]]) -> None:
                    await work()
                    group.cancel_scope.cancel()

                group.start_soon(first, stream)
                group.start_soon(first, disconnect)
        finally:
            with anyio.CancelScope(shield=True):
                await self.chunks.aclose()


async def with_keepalives(
    items: AsyncIterator[T], keepalive: T, every: float = hostapi.KEEPALIVE_EVERY
) -> AsyncGenerator[T, None]:
    """The items, and ``keepalive`` after each ``every`` seconds of silence."""
    it = aiter(items)
    waiting: asyncio.Future[T] | None = None
    try:
        while True:
            if waiting is None:
                waiting = asyncio.ensure_future(anext(it))
            done, _ = await asyncio.wait({waiting}, timeout=every)
            if not done:
                yield keepalive
                continue
            arrived, waiting = waiting, None
            try:
                frame = arrived.result()
            except StopAsyncIteration:
                return
            yield frame
    finally:
        if waiting is not None:
            waiting.cancel()
            with contextlib.suppress(BaseException):
                await waiting
        if isinstance(it, AsyncGenerator):
            await it.aclose()


async def _next_chunk(chunks: AsyncIterator[bytes]) -> bytes | None:
    """The body's next chunk, None at its end; a client that stalls is given up on."""
    try:
        async with asyncio.timeout(BODY_SILENCE):
            return await anext(chunks)
    except StopAsyncIteration:
        return None
    except TimeoutError:
        raise errors.InvalidInput(f"the upload sent nothing for {BODY_SILENCE:g} s") from None


class HostAPI:
    def __init__(
        self,
        nc: Client,
        topology: subjects.Topology,
        resolver: sessions.Resolver,
        executor: rpc.ExecClient,
    ) -> None:
        self.nc = nc
        self.topology = topology
        self.resolver = resolver
        self.executor = executor

    # ---- helpers ---------------------------------------------------------------------------

    @staticmethod
    def who(request: Request) -> sessions.Identity:
        return sessions.identity_from_headers(
            request.headers, session_id=request.path_params["session_id"], via="rest"
        )

    @staticmethod
    async def json(request: Request, body_type: type[_Body]) -> _Body:
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > BODY_MAX:
                raise errors.InvalidInput(f"request body is larger than {BODY_MAX} bytes")
        try:
            return msgspec.json.decode(bytes(raw), type=body_type)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise errors.InvalidInput(f"invalid request body: {exc}") from None

    async def _start(
        self,
        who: sessions.Identity,
        receiver: streams.Receiver,
        run_id: str,
        build: Callable[..., execution.AnyRequest],
        expected: str | None = None,
        claim: bool = True,
    ) -> tuple[str, execution.Reply]:
        stop = self.topology.exec_stop(who.session_id, run_id)

        async def call(sandbox_id: str) -> tuple[str, execution.Reply]:
            if expected is not None and sandbox_id != expected:
                raise errors.SandboxChanged(
                    f"session {who.session_id!r} is now served by sandbox {sandbox_id}, not {expected}; "
                    "nothing was done: sync everything again"
                )
            request = build(
                **self.resolver.request_fields(who, sandbox_id), inbox=receiver.subject, stop=stop
            )
            return sandbox_id, await self.executor.run(request, budget=START_BUDGET)

        if claim:
            return await self.resolver.with_sandbox(who, call)
        running = self.resolver.running_sandbox
        sandbox_id = await running(who.session_id, who.org_id) if running is not None else None
        if sandbox_id is None:
            sandbox_id = await self._resumed(who)
        if sandbox_id is None:
            raise errors.NotFound(
                f"session {who.session_id!r} has no running sandbox "
                "(a download never starts one: run something first)"
            )
        return await call(sandbox_id)

    async def _resumed(self, who: sessions.Identity) -> str | None:
        """The session's sandbox if it was paused and runs again now; None if it has none to
        resume (none, stopped, another organisation's): a download never starts one."""
        command = commands.ResumeSession(
            session_id=who.session_id,
            command_id=ids.new_id(),
            correlation_id=who.correlation_id,
            actor=who.actor,
            reason="call",
        )
        try:
            sandbox = (await self.resolver.commands.call(command)).sandbox
        except (errors.NotFound, errors.Conflict):
            return None
        return sandbox.sandbox_id if sandbox is not None and sandbox.status == "running" else None

    async def open(
        self,
        who: sessions.Identity,
        build: Callable[..., execution.AnyRequest],
        expected: str | None = None,
        claim: bool = True,
    ) -> tuple[streams.Receiver, str, str, execution.Reply]:
        """Subscribe a receiver, start the operation; (receiver, run id, sandbox id, reply).
        The receiver is closed again if the start fails."""
        run_id = ids.new_id()
        receiver = await streams.Receiver(self.nc).__aenter__()
        try:
            sandbox_id, reply = await self._start(who, receiver, run_id, build, expected, claim)
        except BaseException:
            await receiver.__aexit__()
            raise
        return receiver, run_id, sandbox_id, reply

    async def events(
        self,
        receiver: streams.Receiver,
        stop: str,
        feed: Awaitable[None] | None = None,
        keepalive: bool = True,
    ) -> AsyncGenerator[tuple[bytes, bytes], None]:
        """The executor's frames as (channel, data), ending with an end or error frame
        (keepalives while it is quiet, if asked); if the consumer goes away first, the work
        is stopped."""
        ended = False
        feeder = asyncio.ensure_future(feed) if feed is not None else None
        frames = receiver.frames()
        try:
            async for frame in with_keepalives(frames, KEEPALIVE_FRAME) if keepalive else frames:
                if frame.channel in (hostapi.END, hostapi.ERROR):
                    ended = True
                yield frame.channel, frame.data
        except errors.SandboxError as exc:
            ended = True
            yield hostapi.ERROR, msgspec.json.encode(streams.ErrorBody.of(exc))
        finally:
            if feeder is not None:
                feeder.cancel()
                with contextlib.suppress(BaseException):
                    await feeder
            if not ended:
                with contextlib.suppress(Exception):
                    await self.nc.publish(stop, b"stop")
            await receiver.__aexit__()

    @staticmethod
    async def _encoded(
        events: AsyncGenerator[tuple[bytes, bytes], None], encode: Callable[[bytes, bytes], bytes]
    ) -> AsyncGenerator[bytes, None]:
        try:
            async for channel, data in events:
                yield encode(channel, data)
        finally:
            await events.aclose()

    @staticmethod
    def headers(sandbox_id: str, run_id: str) -> dict[str, str]:
        return {"x-sandbox-id": sandbox_id, "x-run-id": run_id, "cache-control": "no-store"}

    # ---- endpoints ---------------------------------------------------------------------------

    async def run(self, request: Request) -> Response:
        who = self.who(request)
        media_type = media.negotiate(request.headers.get("accept"), media.RUN_MEDIA_TYPES)
        body = await self.json(request, hostapi.RunBody)
        checks.run(body)  # before a sandbox is claimed for it
        receiver, run_id, sandbox_id, _ = await self.open(
            who,
            lambda **fields: execution.Run(
                command=body.command,
                cwd=body.cwd,
                env=body.env,
                unset=body.unset,
                timeout=body.timeout,
                list_root=body.list_root,
                prune=body.prune,
                **fields,
            ),
            body.sandbox_id,
        )
        stop = self.topology.exec_stop(who.session_id, run_id)
        events = self.events(receiver, stop)
        encoder = media.RunEncoder(media_type)
        return LiveStream(self._encoded(events, encoder.encode), self.headers(sandbox_id, run_id), media_type)

    async def stop(self, request: Request) -> Response:
        who = self.who(request)
        run_id = request.path_params["run_id"]
        if not (len(run_id) == 32 and all(c in "0123456789abcdef" for c in run_id)):
            raise errors.InvalidInput("run id must be the 32 hex characters of the X-Run-Id header")
        await self.nc.publish(self.topology.exec_stop(who.session_id, run_id), b"stop")
        return Response(status_code=202)

    async def get(self, request: Request) -> Response:
        who = self.who(request)
        body = await self.json(request, hostapi.GetBody)
        hostapi.validate_root(body.root)
        for path in body.paths:
            hostapi.validate_relative(path)
        names = b"".join(path.encode(errors="surrogateescape") + b"\0" for path in body.paths)
        receiver, run_id, sandbox_id, reply = await self.open(
            who, lambda **fields: execution.GetFiles(root=body.root, **fields)
        )

        async def feed() -> None:
            assert reply.input is not None
            async with streams.Sender(self.nc, reply.input) as sender:
                await sender.send(hostapi.TAR, names)
                await sender.end(b"")

        stop = self.topology.exec_stop(who.session_id, run_id)
        frames = self._encoded(self.events(receiver, stop, feed()), hostapi.frame)
        return LiveStream(frames, self.headers(sandbox_id, run_id), hostapi.MEDIA_TYPE)

    async def put(self, request: Request) -> Response:
        """The upload is forwarded as it arrives (in frames of up to ``streams.CHUNK``,
        however small the client's were); the answer (the listing) starts once the upload
        is done, streamed (see :meth:`upload`). If the executor's side ends first, the rest
        of the upload is not read."""
        who = self.who(request)
        upload = _Upload(aiter(request.stream()))
        params = await upload.params()
        receiver, run_id, sandbox_id, reply = await self.open(
            who,
            lambda **fields: execution.PutFiles(
                root=params.root,
                delete=params.delete,
                prune=params.prune,
                listing=params.listing,
                list_paths=params.list_paths,
                **fields,
            ),
            params.sandbox_id,
        )
        answer = await self.upload(who, run_id, receiver, reply, upload.tar())
        frames = self._encoded(answer, hostapi.frame)
        return LiveStream(frames, self.headers(sandbox_id, run_id), hostapi.MEDIA_TYPE)

    async def upload(
        self,
        who: sessions.Identity,
        run_id: str,
        receiver: streams.Receiver,
        reply: execution.Reply,
        tar: AsyncIterator[bytes],
    ) -> AsyncGenerator[tuple[bytes, bytes], None]:
        """Forward ``tar`` to a started upload; its answer's frames, once the upload is done
        (or its answer ended first: then the rest of the upload is not read).

        Nothing of the answer is held here: while the upload goes on, its frames are read
        only up to the first that is not its end. A listing's frames then wait, flow
        controlled, in the executor and the sandbox's pipe until the upload is done and
        the caller reads them (an HTTP client reads its answer only after sending)."""
        stop = self.topology.exec_stop(who.session_id, run_id)
        events = self.events(receiver, stop, keepalive=False)
        first = asyncio.ensure_future(_first(events))
        uploader = asyncio.create_task(forward_tar(self.nc, reply.input, tar))
        try:
            await asyncio.wait({first, uploader}, return_when=asyncio.FIRST_COMPLETED)
            if first.done() and first.result()[0] in (hostapi.END, hostapi.ERROR):
                uploader.cancel()  # the sandbox's side ended first: the rest is not wanted
                with contextlib.suppress(BaseException):
                    await uploader
            else:
                await uploader  # a bad upload: its error
            held = await first
        except BaseException:
            for task in (first, uploader):
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            await events.aclose()  # publishes the stop
            raise
        return _prepend(held, events)

    def routes(self) -> list[BaseRoute]:
        return rest.routes(self, OPERATIONS, failed=FAILED)


class _Upload:
    """The body of ``files/put``: a ``j`` frame of parameters, then ``t`` frames of a tar."""

    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        self.chunks = chunks
        self.reader = hostapi.FrameReader()
        self.early: list[tuple[bytes, bytes]] = []

    async def params(self) -> hostapi.PutParams:
        while not self.early:
            chunk = await _next_chunk(self.chunks)
            if chunk is None:
                break
            self.early += self.reader.feed(chunk)
        if not self.early or self.early[0][0] != hostapi.PARAMS:
            raise errors.InvalidInput("an upload starts with a 'j' frame of JSON parameters")
        try:
            return msgspec.json.decode(self.early.pop(0)[1], type=hostapi.PutParams)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise errors.InvalidInput(f"invalid upload parameters: {exc}") from None

    async def tar(self) -> AsyncIterator[bytes]:
        """The tar's bytes, from the ``t`` frames after the parameters."""
        frames = self.early
        while True:
            for channel, data in frames:
                if channel != hostapi.TAR:
                    raise errors.InvalidInput("after the parameters, an upload is 't' frames")
                yield data
            chunk = await _next_chunk(self.chunks)
            if chunk is None:
                break
            frames = list(self.reader.feed(chunk))
        if self.reader.pending:
            raise errors.InvalidInput("the upload ended in the middle of a frame")


async def body(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """A request body's chunks; a client that stalls is given up on."""
    while (chunk := await _next_chunk(chunks)) is not None:
        yield chunk


async def forward_tar(nc: Client, subject: str | None, tar: AsyncIterator[bytes]) -> None:
    """Forward tar bytes to ``subject`` in frames of :data:`streams.CHUNK` (however the
    client cut them). If the sandbox stops reading, its answer says why."""
    assert subject is not None  # (the executor says where, for an upload)
    pending = bytearray()
    try:
        async with streams.Sender(nc, subject) as sender:
            async for data in tar:
                pending += data
                while len(pending) >= streams.CHUNK:
                    await sender.send(hostapi.TAR, bytes(pending[: streams.CHUNK]))
                    del pending[: streams.CHUNK]
            if pending:
                await sender.send(hostapi.TAR, bytes(pending))
            await sender.end(b"")
    except streams.Aborted:
        pass


async def _first(events: AsyncGenerator[tuple[bytes, bytes], None]) -> tuple[bytes, bytes]:
    try:
        return await anext(events)
    except StopAsyncIteration:
        raise errors.Unavailable("the sandbox's answer ended early; the outcome is unknown") from None


async def _prepend(
    held: tuple[bytes, bytes], events: AsyncGenerator[tuple[bytes, bytes], None]
) -> AsyncGenerator[tuple[bytes, bytes], None]:
    """``held``, then the rest of ``events`` (closed at the end, or when this is)."""
    try:
        yield held
        if held[0] not in (hostapi.END, hostapi.ERROR):
            async for event in events:
                yield event
    finally:
        await events.aclose()
