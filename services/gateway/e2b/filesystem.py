"""envd's filesystem: ``filesystem.Filesystem`` Stat, ListDir, MakeDir, Move, Remove (each
one executor ``files`` operation), WatchDir (the streamed ``watch_dir``), the polling
watcher (CreateWatcher, GetWatcherEvents, RemoveWatcher: ``watch``) and ``GET``/``POST
/files`` (a file's bytes streamed from the executor's ``read_file``, or into its
``write_file``: octet-stream, gzip or multipart bodies, one file or many). Paths are only
text here (see :mod:`.entries`); nothing of a file is held beyond one chunk."""

from __future__ import annotations

import asyncio
import contextlib
import zlib
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import msgspec
import structlog
from python_multipart import multipart
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from sbx_api import errors, hostapi
from services.gateway import hostapi as host_api
from services.gateway.e2b import calls, connect, entries
from shared.contract import execution, states
from shared.infrastructure import streams

log = structlog.get_logger(__name__)

FILES = "/files"
MAX_PARTS = 1000
"""Most files one multipart upload writes."""
MISSING, NOT_DIR, IS_DIR = 44, 45, 46
"""The executor's exit codes for a path that does not exist, or is a directory."""
Frames = AsyncGenerator[tuple[bytes, bytes], None]


class PathRequest(msgspec.Struct, frozen=True):
    path: str = ""


class ListDirRequest(msgspec.Struct, frozen=True):
    path: str = ""
    depth: int = 0


class MoveRequest(msgspec.Struct, frozen=True):
    source: str = ""
    destination: str = ""


class WatchRequest(msgspec.Struct, frozen=True):
    """``WatchDirRequest`` and ``CreateWatcherRequest`` (``include_entry`` and
    ``allow_network_mounts`` are not sent by an SDK told envd 0.5.7)."""

    path: str = ""
    recursive: bool = False


class WatcherRequest(msgspec.Struct, frozen=True):
    watcher_id: str = msgspec.field(default="", name="watcherId")


EVENT_TYPES = {
    "create": "EVENT_TYPE_CREATE",
    "write": "EVENT_TYPE_WRITE",
    "remove": "EVENT_TYPE_REMOVE",
    "rename": "EVENT_TYPE_RENAME",
    "chmod": "EVENT_TYPE_CHMOD",
}
_changes = msgspec.json.Decoder(list[execution.Change])


def event_of(change: execution.Change) -> dict[str, str]:
    """A change as envd's ``FilesystemEvent``."""
    return {"name": change.name, "type": EVENT_TYPES[change.kind]}


def _watch_failed(channel: bytes, data: bytes, path: str) -> connect.ConnectError:
    """Why a watch ended: its directory went (or was never one), or the executor's error."""
    if channel == hostapi.ERROR:
        failed = msgspec.json.decode(data, type=streams.ErrorBody)
        return connect.ConnectError("internal", failed.message)
    end = msgspec.json.decode(data, type=hostapi.End)
    if end.exit_code == NOT_DIR:
        return connect.ConnectError("invalid_argument", f"{path} is not a directory")
    if end.exit_code == MISSING:
        return connect.ConnectError("not_found", f"{path} does not exist (any more)")
    return connect.ConnectError("aborted", f"the watch of {path} ended ({end.message or end.exit_code})")


class FilesError(Exception):
    """A ``/files`` failure, answered as envd's REST errors: ``{"code": status, "message"}``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _http_error(status: int, message: str) -> FilesError:
    return FilesError(status, message)


class Filesystem:
    def __init__(self, host: host_api.HostAPI) -> None:
        self.host = host

    async def _files(self, session: states.SessionState, build: Any) -> execution.Reply:
        return await calls.call(self.host, session, build)

    # ---- filesystem.Filesystem -------------------------------------------------------------------

    async def stat(self, session: states.SessionState, raw: bytes) -> dict[str, Any]:
        path = entries.resolve(connect.decode(raw, PathRequest).path)
        reply = await self._files(session, lambda **f: execution.Files(action="stat", path=path, **f))
        return {"entry": entries.entry_info(self._found(reply, path)[0])}

    async def list_dir(self, session: states.SessionState, raw: bytes) -> dict[str, Any]:
        asked = connect.decode(raw, ListDirRequest)
        path, depth = entries.resolve(asked.path), asked.depth or 1
        reply = await self._files(
            session, lambda **f: execution.Files(action="list", path=path, depth=depth, **f)
        )
        return {"entries": [entries.entry_info(entry) for entry in self._found(reply, path)]}

    async def make_dir(self, session: states.SessionState, raw: bytes) -> dict[str, Any]:
        path = entries.resolve(connect.decode(raw, PathRequest).path)
        reply = await self._files(session, lambda **f: execution.Files(action="mkdir", path=path, **f))
        if reply.created is False:
            raise connect.ConnectError("already_exists", f"directory {path} already exists")
        stat = await self._files(session, lambda **f: execution.Files(action="stat", path=path, **f))
        return {"entry": entries.entry_info(self._found(stat, path)[0])}

    async def move(self, session: states.SessionState, raw: bytes) -> dict[str, Any]:
        asked = connect.decode(raw, MoveRequest)
        source, destination = entries.resolve(asked.source), entries.resolve(asked.destination)
        reply = await self._files(
            session,
            lambda **f: execution.Files(action="move", path=source, destination=destination, **f),
        )
        return {"entry": entries.entry_info(self._found(reply, source)[0])}

    async def remove(self, session: states.SessionState, raw: bytes) -> dict[str, Any]:
        path = entries.resolve(connect.decode(raw, PathRequest).path)
        self._found(
            await self._files(session, lambda **f: execution.Files(action="remove", path=path, **f)), path
        )
        return {}

    # ---- watching ------------------------------------------------------------------------------

    async def create_watcher(self, session: states.SessionState, raw: bytes) -> dict[str, Any]:
        asked = connect.decode(raw, WatchRequest)
        path = entries.resolve(asked.path)
        reply = await self._files(
            session,
            lambda **f: execution.Watch(action="create", path=path, recursive=asked.recursive, **f),
        )
        return {"watcherId": reply.watcher_id}

    async def get_watcher_events(self, session: states.SessionState, raw: bytes) -> dict[str, Any]:
        watcher = connect.decode(raw, WatcherRequest).watcher_id
        reply = await self._files(
            session, lambda **f: execution.Watch(action="poll", watcher_id=watcher, **f)
        )
        return {"events": [event_of(change) for change in reply.changes or []]}

    async def remove_watcher(self, session: states.SessionState, raw: bytes) -> dict[str, Any]:
        watcher = connect.decode(raw, WatcherRequest).watcher_id
        await self._files(session, lambda **f: execution.Watch(action="remove", watcher_id=watcher, **f))
        return {}

    async def watch_dir(self, session: states.SessionState, raw: bytes) -> AsyncGenerator[bytes, None]:
        """The executor's ``watch_dir``: ``start`` once its first listing is taken (a change
        made after the SDK has the start is seen), then each change as a ``filesystem``
        event; the watch ends when the client goes away."""
        asked = connect.decode(raw, WatchRequest)
        path = entries.resolve(asked.path)
        frames, _ = await calls.stream(
            self.host,
            session,
            lambda **f: execution.WatchDir(path=path, recursive=asked.recursive, **f),
        )
        try:
            async for channel, data in frames:
                if channel == hostapi.STDOUT:
                    break
                if channel in (hostapi.END, hostapi.ERROR):
                    raise _watch_failed(channel, data, path)
            else:
                raise connect.ConnectError("unavailable", "the watch ended before it began")
        except BaseException:
            await frames.aclose()
            raise
        return self._watch_events(frames, path)

    @staticmethod
    async def _watch_events(frames: Frames, path: str) -> AsyncGenerator[bytes, None]:
        try:
            yield connect.message({"start": {}})
            async for channel, data in frames:
                if channel == hostapi.STDOUT:
                    for change in _changes.decode(data):
                        yield connect.message({"filesystem": event_of(change)})
                elif channel == hostapi.KEEPALIVE:
                    yield connect.message({"keepalive": {}})
                elif channel in (hostapi.END, hostapi.ERROR):
                    yield connect.end_stream(_watch_failed(channel, data, path))
                    return
        finally:
            await frames.aclose()

    @staticmethod
    def _found(reply: execution.Reply, path: str) -> list[execution.Entry]:
        if reply.exists is False:
            raise connect.ConnectError("not_found", f"{path} does not exist")
        return reply.entries or []

    # ---- GET/POST /files -------------------------------------------------------------------------

    async def serve(
        self, session: states.SessionState, query: dict[str, str], scope: Scope, receive: Receive, send: Send
    ) -> None:
        """``/files`` with its query (:func:`signing.query`): GET reads, POST writes."""
        started = False

        async def sending(message: Any) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            if scope["method"] == "GET":
                await self.read(session, entries.resolve(query.get("path", "")), sending)
                return
            if scope["method"] != "POST":
                raise _http_error(405, "GET or POST /files")
            written = await self.write(session, query.get("path"), Request(scope, receive))
        except (errors.SandboxError, FilesError) as exc:
            if started:  # the answer is cut short: the client sees an incomplete body
                log.warning("e2b.files.read_cut_short", error=exc.message[:200])
                return
            status = exc.status if exc.status >= 400 else 500
            await connect.respond(
                send,
                status,
                msgspec.json.encode({"code": status, "message": exc.message}),
                connect.UNARY_JSON,
            )
            return
        await connect.respond(send, 200, msgspec.json.encode(written), connect.UNARY_JSON)

    async def read(self, session: states.SessionState, path: str, send: Send) -> None:
        frames, _ = await calls.stream(self.host, session, lambda **f: execution.ReadFile(path=path, **f))
        try:
            channel, data = await _next(frames)
            if channel != hostapi.STDOUT:
                _ended(channel, data, path)  # an error, or an empty file
            headers = [(b"content-type", b"application/octet-stream"), (b"cache-control", b"no-store")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            while channel == hostapi.STDOUT:
                await send({"type": "http.response.body", "body": data, "more_body": True})
                channel, data = await _next(frames)
            # An error now cannot change the status: the answer is cut short (an error to any
            # HTTP client reading it whole), never ended as if it were the whole file.
            _ended(channel, data, path)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await frames.aclose()

    async def write(self, session: states.SessionState, path: str | None, request: Request) -> list[Any]:
        kind, _ = multipart.parse_options_header(request.headers.get("content-type"))
        body = host_api.body(aiter(request.stream()))
        if kind == b"multipart/form-data":
            return await self._multipart(session, path, request, body)
        if path is None:
            raise errors.InvalidInput("POST /files with an octet-stream body needs ?path=")
        encoding = request.headers.get("content-encoding", "identity").lower()
        if encoding not in ("identity", "gzip"):
            raise _http_error(415, f"Content-Encoding {encoding[:40]!r} is not accepted (gzip is)")
        resolved = entries.resolve(path)
        await self.write_one(session, resolved, _gunzip(body) if encoding == "gzip" else body)
        return [entries.write_info(resolved)]

    async def write_one(self, session: states.SessionState, path: str, data: AsyncIterator[bytes]) -> None:
        """``data`` written to the file at ``path`` in the sandbox, as it comes."""
        frames, reply = await calls.stream(
            self.host, session, lambda **f: execution.WriteFile(path=path, **f)
        )
        uploader = asyncio.ensure_future(host_api.forward_tar(self.host.nc, reply.input, data))
        ended = asyncio.ensure_future(_end(frames))
        try:
            await asyncio.wait({uploader, ended}, return_when=asyncio.FIRST_COMPLETED)
            if uploader.done() and uploader.exception() is not None:
                uploader.result()  # a bad upload: its error
            channel, payload = await ended
        finally:
            for task in (uploader, ended):
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            await frames.aclose()
        _ended(channel, payload, path)

    async def _multipart(
        self, session: states.SessionState, path: str | None, request: Request, body: AsyncIterator[bytes]
    ) -> list[Any]:
        _, options = multipart.parse_options_header(request.headers.get("content-type"))
        boundary = options.get(b"boundary")
        if not boundary:
            raise errors.InvalidInput("a multipart body needs its boundary")
        parts = _Parts(boundary)
        written: list[Any] = []
        current: tuple[asyncio.Queue[bytes | None], asyncio.Future[None]] | None = None
        try:
            async for chunk in body:
                for event, data in parts.feed(chunk):
                    if event == "begin":
                        target = entries.resolve(_target(path, data, len(written)))
                        queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=4)
                        current = (
                            queue,
                            asyncio.ensure_future(self.write_one(session, target, _drain(queue))),
                        )
                        written.append(entries.write_info(target))
                    elif current is not None and event == "data":
                        await _put(current, data)
                    elif current is not None and event == "end":
                        await _put(current, None)
                        await current[1]
                        current = None
        finally:
            if current is not None:
                current[1].cancel()
                with contextlib.suppress(BaseException):
                    await current[1]
        if not written:
            raise errors.InvalidInput("the multipart body holds no file")
        return written


class _Parts:
    """A streamed multipart body as events: ``begin`` (the part's Content-Disposition
    filename, b'' if none), ``data``, ``end``; at most :data:`MAX_PARTS` parts."""

    def __init__(self, boundary: bytes) -> None:
        self.events: list[tuple[str, bytes]] = []
        self.header = b""
        self.value = b""
        self.filename = b""
        self.count = 0
        self.parser = multipart.MultipartParser(
            boundary,
            {
                "on_part_begin": self._begin,
                "on_header_field": lambda d, s, e: self._field(d[s:e]),
                "on_header_value": lambda d, s, e: self._value(d[s:e]),
                "on_header_end": self._header_end,
                "on_headers_finished": lambda: self.events.append(("begin", self.filename)),
                "on_part_data": lambda d, s, e: self.events.append(("data", bytes(d[s:e]))),
                "on_part_end": lambda: self.events.append(("end", b"")),
            },
        )

    def _begin(self) -> None:
        self.count += 1
        if self.count > MAX_PARTS:
            raise errors.InvalidInput(f"at most {MAX_PARTS} files in one upload")
        self.header = self.value = self.filename = b""

    def _field(self, data: bytes) -> None:
        self.header += data

    def _value(self, data: bytes) -> None:
        self.value += data

    def _header_end(self) -> None:
        if self.header.lower() == b"content-disposition":
            _, options = multipart.parse_options_header(self.value)
            self.filename = options.get(b"filename", b"")
        self.header = self.value = b""

    def feed(self, chunk: bytes) -> list[tuple[str, bytes]]:
        try:
            self.parser.write(chunk)
        except multipart.MultipartParseError as exc:
            raise errors.InvalidInput(f"malformed multipart body: {str(exc)[:200]}") from None
        events, self.events = self.events, []
        return events


def _target(path: str | None, filename: bytes, index: int) -> str:
    """Where a part goes: the query's ``path`` (one file), else the part's filename."""
    if path is not None:
        if index:
            raise errors.InvalidInput("?path= names one file: send one part, or name each by its filename")
        return path
    if not filename:
        raise errors.InvalidInput("a part without a filename (the file's path) and no ?path=")
    return filename.decode(errors="replace")


async def _put(current: tuple[asyncio.Queue[bytes | None], asyncio.Future[None]], data: bytes | None) -> None:
    """Hand a part's data to its writer, or fail with the writer's own failure."""
    queue, writer = current
    put = asyncio.ensure_future(queue.put(data))
    await asyncio.wait({put, writer}, return_when=asyncio.FIRST_COMPLETED)
    if not put.done():
        put.cancel()
        writer.result()  # ended early: its error (or the sandbox's side stopped reading)
        raise errors.Unavailable("the sandbox stopped taking the file")


async def _drain(queue: asyncio.Queue[bytes | None]) -> AsyncIterator[bytes]:
    while (data := await queue.get()) is not None:
        yield data


async def _gunzip(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """A gzip body decompressed as it comes, never more than a chunk at a time."""
    inflater = zlib.decompressobj(wbits=31)
    try:
        async for chunk in chunks:
            while chunk:
                out = inflater.decompress(chunk, streams.CHUNK)
                chunk = inflater.unconsumed_tail
                if out:
                    yield out
        if not inflater.eof:
            raise errors.InvalidInput("the gzip body ended early")
    except zlib.error as exc:
        raise errors.InvalidInput(f"not a gzip body: {exc}") from None


async def _next(frames: Frames) -> tuple[bytes, bytes]:
    """The next frame that is not a keepalive."""
    async for channel, data in frames:
        if channel != hostapi.KEEPALIVE:
            return channel, data
    raise errors.Unavailable("the sandbox's answer ended early")


async def _end(frames: Frames) -> tuple[bytes, bytes]:
    """The end (or error) frame of an operation that streams nothing else."""
    while True:
        channel, data = await _next(frames)
        if channel in (hostapi.END, hostapi.ERROR):
            return channel, data


def _ended(channel: bytes, data: bytes, path: str) -> None:
    """An operation's last frame: returns if it succeeded, else raises what it means."""
    if channel == hostapi.ERROR:
        failed = msgspec.json.decode(data, type=streams.ErrorBody)
        raise _http_error(failed.status if failed.status >= 400 else 500, failed.message)
    if channel != hostapi.END:
        raise errors.InfrastructureError("the sandbox's answer is out of order")
    end = msgspec.json.decode(data, type=hostapi.End)
    if end.timed_out:
        raise _http_error(504, f"{path}: the transfer took too long")
    if end.exit_code == MISSING:
        raise _http_error(404, f"{path} does not exist")
    if end.exit_code == IS_DIR:
        raise _http_error(400, f"{path} is a directory")
    if end.exit_code != 0:
        raise _http_error(500, f"{path}: {end.message or f'exit status {end.exit_code}'}"[:500])
