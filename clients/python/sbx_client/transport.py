"""The host API over HTTP (:mod:`shared.contract.hostapi`): run a command with streamed output,
upload a tar, download paths, stop a run, release a session.

Synchronous, on the standard library's ``http.client``: ``sbx exec`` is started once per
tool call, so what it imports is paid every time (httpx alone costs ~70 ms to import).
One kept-alive connection per ``Transport``; a request on a reused connection that the
gateway had already closed (idle) is sent again on a new one. Every answer is read as
frames (asked for with ``Accept``; keepalive frames are skipped); an error frame or an
error status becomes :class:`ApiError` with the gateway's message.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from urllib.parse import quote, urlsplit

import msgspec

from sbx_client import errors, hostapi

DEFAULT_URL = "http://127.0.0.1:8080"
CONNECT_TIMEOUT = 10.0
READ_TIMEOUT = 90.0
"""Longest silence on a stream (the executor sends heartbeats every few seconds)."""
READ_SIZE = 256 * 1024
LISTING_MAX = 512 * 1024 * 1024
"""The most listing bytes one answer may carry (the sandbox writes them)."""
_STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)


class ApiError(Exception):
    def __init__(
        self, message: str, *, code: str = "error", status: int = 0, retriable: bool = False
    ) -> None:
        super().__init__(message)
        self.message, self.code, self.status, self.retriable = message, code, status, retriable


@dataclass
class Answer:
    """A finished operation: its end frame, the listing it carried, its headers."""

    end: hostapi.End
    listing: bytes = b""
    sandbox_id: str = ""
    run_id: str = ""


Output = Callable[[bytes, bytes], None]
"""Called with (channel, data) for each output frame (``o``/``e``) as it comes."""


class Transport:
    def __init__(
        self,
        url: str,
        api_key: str,
        *,
        org_id: str | None = None,
        user_id: str | None = None,
        timeout: float = READ_TIMEOUT,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ApiError(f"SBX_URL must be an http(s) URL, not {url!r}")
        self.scheme, self.host, self.port = parts.scheme, parts.hostname, parts.port
        self.base = parts.path.rstrip("/")
        self.timeout = timeout
        self.headers = {
            "authorization": f"Bearer {api_key}",
            "user-agent": "sbx-client",
            "accept": f"{hostapi.MEDIA_TYPE}, application/json",
        }
        if org_id:
            self.headers["x-org-id"] = org_id
        if user_id:
            self.headers["x-user-id"] = user_id
        self._conn: http.client.HTTPConnection | None = None
        self._lock = threading.Lock()
        self.current_run: tuple[str, str] | None = None
        """(session, run id) of the run streaming now: what :meth:`stop` stops."""

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _path(self, session: str, tail: str) -> str:
        return f"{self.base}/v1/sessions/{quote(session, safe='')}{tail}"

    def _connect(self, timeout: float | None = None) -> http.client.HTTPConnection:
        kind = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        conn = kind(self.host, self.port, timeout=timeout or self.timeout)
        try:
            conn.connect()
        except OSError as exc:
            raise ApiError(
                f"cannot reach the gateway at {self.scheme}://{self.host}:{self.port or ''}: {exc} "
                "(is `sbx up` running? is SBX_URL right?)",
                retriable=True,
            ) from None
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    def _request(
        self, method: str, path: str, body: bytes | Iterable[bytes] | None = None, content_type: str = ""
    ) -> http.client.HTTPResponse:
        """Send; the response (its status not yet checked). A reused connection the
        gateway closed meanwhile is replaced once (only bytes bodies can be sent twice)."""
        headers = dict(self.headers)
        if content_type:
            headers["content-type"] = content_type
        chunked = body is not None and not isinstance(body, bytes)
        if chunked:
            headers["transfer-encoding"] = "chunked"
        for attempt in range(2):
            reused = self._conn is not None
            if self._conn is None:
                self._conn = self._connect()
            try:
                self._conn.request(method, path, body=body, headers=headers, encode_chunked=chunked)
                return self._conn.getresponse()
            except _STALE:
                self.close()
                if not reused or chunked or attempt:
                    raise ApiError("the gateway closed the connection; the outcome is unknown") from None
            except OSError as exc:
                self.close()
                raise ApiError(f"talking to the gateway failed: {exc}; the outcome is unknown") from None
        raise AssertionError("unreachable")

    # ---- operations ---------------------------------------------------------------------------

    def run(self, session: str, body: hostapi.RunBody, output: Output) -> Answer:
        with self._lock:
            response = self._request(
                "POST", self._path(session, "/run"), msgspec.json.encode(body), "application/json"
            )
            self._check(response)
            self.current_run = (session, response.getheader("x-run-id", ""))
            try:
                return self._frames(response, output, None)
            finally:
                self.current_run = None

    def stop(self) -> None:
        """Stop the run streaming now (from another thread, e.g. on Ctrl-C): on a
        connection of its own."""
        current = self.current_run
        if current is None or not current[1]:
            return
        session, run_id = current
        try:
            conn = self._connect(CONNECT_TIMEOUT)
            try:
                conn.request("POST", self._path(session, f"/runs/{run_id}/stop"), headers=self.headers)
                conn.getresponse().read()
            finally:
                conn.close()
        except (ApiError, OSError, http.client.HTTPException):
            pass  # closing the stream stops it too

    def put(self, session: str, params: hostapi.PutParams, tar: Iterable[bytes]) -> Answer:
        def body() -> Iterator[bytes]:
            yield hostapi.frame(hostapi.PARAMS, msgspec.json.encode(params))
            for chunk in tar:
                if chunk:
                    yield hostapi.frame(hostapi.TAR, chunk)

        with self._lock:
            response = self._request("POST", self._path(session, "/files/put"), body(), hostapi.MEDIA_TYPE)
            self._check(response)
            return self._frames(response, None, None)

    def get(self, session: str, root: str, paths: list[str], tar: Callable[[bytes], None]) -> Answer:
        body = msgspec.json.encode(hostapi.GetBody(root=root, paths=paths))
        with self._lock:
            response = self._request("POST", self._path(session, "/files/get"), body, "application/json")
            self._check(response)
            return self._frames(response, None, tar)

    def release(self, session: str) -> bool:
        """Delete the session and its sandbox; False if there was none."""
        with self._lock:
            response = self._request("DELETE", self._path(session, ""))
            if response.status == 404:
                response.read()
                return False
            self._check(response)
            response.read()
            return True

    # ---- reading answers ----------------------------------------------------------------------

    def _check(self, response: http.client.HTTPResponse) -> None:
        if response.status < 400:
            return
        raw = response.read()
        try:
            problem = json.loads(raw)
            message, code = (
                problem.get("message", raw.decode(errors="replace")),
                problem.get("error", "error"),
            )
            retriable = bool(problem.get("retriable"))
        except (ValueError, AttributeError):
            message, code, retriable = (
                f"HTTP {response.status}: {raw[:300].decode(errors='replace')}",
                "error",
                False,
            )
        raise ApiError(message, code=code, status=response.status, retriable=retriable)

    def _frames(
        self, response: http.client.HTTPResponse, output: Output | None, tar: Callable[[bytes], None] | None
    ) -> Answer:
        reader = hostapi.FrameReader()
        listing = bytearray()
        try:
            while chunk := response.read1(READ_SIZE):
                for channel, data in reader.feed(chunk):
                    if channel in (hostapi.STDOUT, hostapi.STDERR) and output is not None:
                        output(channel, data)
                    elif channel == hostapi.LISTING:
                        listing += data
                        if len(listing) > LISTING_MAX:
                            raise ApiError(f"the sandbox's listing is larger than {LISTING_MAX} bytes")
                    elif channel == hostapi.TAR and tar is not None:
                        tar(data)
                    elif channel == hostapi.END:
                        response.read()  # the rest (nothing): the connection can be reused
                        return _answer(response, data, bytes(listing))
                    elif channel == hostapi.ERROR:
                        response.read()
                        raise _stream_error(data)
        except (OSError, http.client.HTTPException) as exc:
            self.close()
            raise ApiError(f"the stream from the gateway broke: {exc}; the outcome is unknown") from None
        except errors.InvalidInput as exc:  # a malformed frame
            self.close()
            raise ApiError(f"the gateway sent a malformed stream: {exc.message}") from None
        self.close()
        raise ApiError("the gateway closed the stream before the end frame; the outcome is unknown")


def _answer(response: http.client.HTTPResponse, end_frame: bytes, listing: bytes) -> Answer:
    """A stream's answer, from its end frame."""
    try:
        end = msgspec.json.decode(end_frame, type=hostapi.End)
    except msgspec.DecodeError as exc:
        raise ApiError(f"a malformed end frame: {exc}") from None
    return Answer(
        end=end,
        listing=listing,
        sandbox_id=response.getheader("x-sandbox-id", ""),
        run_id=response.getheader("x-run-id", ""),
    )


def _stream_error(error_frame: bytes) -> ApiError:
    """The error an error frame carries (a problem document, or whatever came)."""
    try:
        problem = dict(json.loads(error_frame))
    except (ValueError, TypeError):
        problem = {"message": error_frame[:300].decode(errors="replace")}
    return ApiError(
        problem.get("message", "error"),
        code=problem.get("error", "error"),
        status=int(problem.get("status", 500)),
        retriable=bool(problem.get("retriable")),
    )
