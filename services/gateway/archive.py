"""Plain tar bodies for anyone (curl, a browser's ``fetch``, other languages): download
paths of a session's sandbox as a tar, upload a tar into it.

* ``GET /v1/sessions/{id}/archive?root=/workspace&path=src&path=README.md``: an
  ``application/x-tar`` of those paths (directories with everything under them; no
  ``path``: the whole root). Up to :data:`HOLD` bytes are held back before the answer
  starts, so a small download that fails (a path that does not exist) gets its error
  status; a failure after that breaks the connection, which every client reports.
* ``PUT /v1/sessions/{id}/archive?root=/workspace``: the body is a tar (``curl -T
  project.tar``), extracted into the root (created if missing); answers JSON
  :class:`~sbx_api.hostapi.ArchiveWritten`.

An upload, as the rest of the host API, gives a session with no sandbox one; a download
(a GET: safe) never does: 404 if the session has no running sandbox (a paused one is
resumed: it runs already, frozen).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

import msgspec
import structlog
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute

from sbx_api import errors
from sbx_api import hostapi as contract
from services.gateway import hostapi, media, rest, schemas
from shared.contract import execution
from shared.infrastructure import streams

log = structlog.get_logger(__name__)

HOLD = 1024 * 1024
"""Bytes of a download held back before its answer starts (a failure within them gets its
status, not a broken connection)."""
_NO_DIRECTORY = 3
"""The archive script's exit status when the root is not a directory."""

_ROOT = rest.Param(
    "root",
    "query",
    f"A directory under {contract.WORKSPACE} (default); the tar's paths are relative to it.",
    {"type": "string", "pattern": contract.ROOT_PATTERN, "default": contract.WORKSPACE},
)
_TAR_BYTES = "A tar (POSIX/GNU) of the paths, relative to the root."
OPERATIONS: tuple[rest.Operation, ...] = (
    rest.Operation(
        "GET",
        "/v1/sessions/{session_id}/archive",
        "downloadArchive",
        "Download paths of the sandbox as a tar (curl -o out.tar)",
        "get",
        {
            200: (None, _TAR_BYTES + " A failure once the answer has started breaks the connection."),
            **hostapi.ERRORS,
            404: (
                schemas.Problem,
                "The session has no running or paused sandbox (a download never starts one), or a "
                "path or the root does not exist in it.",
            ),
            406: (schemas.Problem, "The Accept header does not admit application/x-tar."),
        },
        params=(
            hostapi.SESSION,
            _ROOT,
            rest.Param(
                "path",
                "query",
                "A path to include, relative to the root (repeat for more); none: the whole root.",
                {"type": "array", "items": {"type": "string", "pattern": contract.RELATIVE_PATTERN}},
            ),
            *rest.ATTRIBUTION,
        ),
        tag="host",
        answer_media=((contract.TAR_MEDIA_TYPE, None),),
        answer_headers=("X-Sandbox-Id", "X-Run-Id"),
    ),
    rest.Operation(
        "PUT",
        "/v1/sessions/{session_id}/archive",
        "uploadArchive",
        "Upload a tar and extract it into the sandbox (curl -T project.tar)",
        "put",
        {
            200: (contract.ArchiveWritten, "Extracted."),
            **hostapi.ERRORS,
            400: (
                schemas.Problem,
                "Invalid input, or not a tar (what came before the error may be written).",
            ),
            415: (schemas.Problem, "The body's Content-Type is not application/x-tar."),
        },
        params=(hostapi.SESSION, _ROOT, *rest.ATTRIBUTION),
        tag="host",
        body_media_type=contract.TAR_MEDIA_TYPE,
        answer_headers=("X-Sandbox-Id", "X-Run-Id"),
    ),
)


def _root(request: Request, allowed: frozenset[str]) -> str:
    """The ``root`` query parameter, validated; unknown parameters are refused (a typo
    would otherwise be ignored)."""
    unknown = sorted(set(request.query_params) - allowed)
    if unknown:
        raise errors.InvalidInput(
            f"unknown query parameter {unknown[0]!r}; known: {', '.join(sorted(allowed))}"
        )
    roots = request.query_params.getlist("root")
    if len(roots) > 1:
        raise errors.InvalidInput("give root once")
    return contract.validate_root(roots[0] if roots else contract.WORKSPACE)


def _refused(root: str, end: contract.End) -> errors.SandboxError:
    """What a tar that failed before anything was sent means for the caller."""
    why = end.message or f"tar exited with status {end.exit_code}"
    if end.exit_code == _NO_DIRECTORY:
        return errors.NotFound(f"{root} is not a directory in the sandbox")
    if "No such file or directory" in why:
        return errors.NotFound(f"not in the sandbox: {why}")
    return errors.Conflict(f"the sandbox could not archive the paths: {why}")


def _problem(data: bytes) -> errors.SandboxError:
    """An error frame's error, as the error it was."""
    try:
        body = msgspec.json.decode(data, type=contract.Failed)
    except msgspec.DecodeError:
        return errors.Unavailable("the executor's error was malformed")
    return errors.from_code(body.error, body.message)


class Broken(Exception):
    """A download failed after its answer started: the connection is broken on purpose."""


class ArchiveAPI:
    def __init__(self, host: hostapi.HostAPI) -> None:
        self.host = host

    def routes(self) -> list[BaseRoute]:
        return rest.routes(self, OPERATIONS, failed=hostapi.FAILED)

    async def get(self, request: Request) -> Response:
        who = self.host.who(request)
        media.negotiate(request.headers.get("accept"), (contract.TAR_MEDIA_TYPE,))
        root = _root(request, frozenset(("root", "path")))
        paths = [contract.validate_relative(path) for path in request.query_params.getlist("path")] or ["."]
        names = b"".join(path.encode(errors="surrogateescape") + b"\0" for path in paths)
        receiver, run_id, sandbox_id, reply = await self.host.open(
            who, lambda **fields: execution.GetFiles(root=root, recursive=True, **fields), claim=False
        )

        async def feed() -> None:
            assert reply.input is not None
            async with streams.Sender(self.host.nc, reply.input) as sender:
                await sender.send(contract.TAR, names)
                await sender.end(b"")

        stop = self.host.topology.exec_stop(who.session_id, run_id)
        events = self.host.events(receiver, stop, feed(), keepalive=False)
        headers = self.host.headers(sandbox_id, run_id)
        held = bytearray()
        try:
            async for channel, data in events:
                if channel == contract.TAR:
                    held += data
                    if len(held) >= HOLD:
                        break
                elif channel == contract.END:
                    end = msgspec.json.decode(data, type=contract.End)
                    if end.exit_code != 0:
                        raise _refused(root, end)
                    return Response(bytes(held), 200, headers, contract.TAR_MEDIA_TYPE)
                elif channel == contract.ERROR:
                    raise _problem(data)
            else:
                raise errors.Unavailable("the sandbox's answer ended early; the outcome is unknown")
        except BaseException:
            await events.aclose()
            raise
        return hostapi.LiveStream(
            self._rest(bytes(held), events, who.session_id), headers, contract.TAR_MEDIA_TYPE
        )

    @staticmethod
    async def _rest(
        held: bytes, events: AsyncGenerator[tuple[bytes, bytes], None], session_id: str
    ) -> AsyncGenerator[bytes, None]:
        try:
            yield held
            async for channel, data in events:
                if channel == contract.TAR:
                    yield data
                elif channel == contract.END:
                    end = msgspec.json.decode(data, type=contract.End)
                    if end.exit_code == 0:
                        return
                    why = end.message or f"tar exited with status {end.exit_code}"
                    break
                elif channel == contract.ERROR:
                    why = _problem(data).message
                    break
            else:
                why = "the sandbox's answer ended early"
        finally:
            await events.aclose()
        log.warning("archive.broken", session_id=session_id, error=why[:300])
        raise Broken(f"the download failed after it started: {why}")

    async def put(self, request: Request) -> Response:
        who = self.host.who(request)
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind not in ("", contract.TAR_MEDIA_TYPE):
            raise errors.UnsupportedMediaType(
                f"the body is a tar: Content-Type: {contract.TAR_MEDIA_TYPE} (or none), not {kind[:100]!r}"
            )
        root = _root(request, frozenset(("root",)))
        receiver, run_id, sandbox_id, reply = await self.host.open(
            who,
            lambda **fields: execution.PutFiles(root=root, delete=[], prune=[], listing=False, **fields),
        )
        answer = await self.host.upload(who, run_id, receiver, reply, hostapi.body(aiter(request.stream())))
        try:
            channel, data = await anext(answer)
        finally:
            await answer.aclose()  # anything else: the work is stopped
        if channel == contract.ERROR:
            raise _problem(data)
        if channel != contract.END:  # (the executor sends nothing else without a listing)
            raise errors.Unavailable("the sandbox answered an upload with output nobody asked for")
        end = msgspec.json.decode(data, type=contract.End)
        if end.exit_code != 0:
            raise errors.InvalidInput(
                f"{end.message or 'extracting failed'} (what came before the error may have been written)"
            )
        written = contract.ArchiveWritten(sandbox_id=sandbox_id, duration=end.duration)
        return rest.json_response(written, 200, **self.host.headers(sandbox_id, run_id))
