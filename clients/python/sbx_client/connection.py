"""HTTP to the gateway on the standard library's ``http.client`` (``sbx exec`` is started
once per agent tool call, so what it imports is paid every time: httpx alone costs ~70 ms).

:class:`Gateway` knows where the gateway is and who we are, and keeps one idle
connection for the next request (a stream in progress holds its own, so a second request
meanwhile opens another). A request on a kept connection that the gateway had closed
meanwhile (idle) is sent again on a new one, when its body can be sent twice. Every error
answer becomes :class:`ApiError` with the problem document's code, message, status and
``retriable``.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
from collections.abc import Iterable, Mapping
from urllib.parse import quote, urlencode, urlsplit

DEFAULT_URL = "http://127.0.0.1:8080"
CONNECT_TIMEOUT = 10.0
READ_TIMEOUT = 90.0
"""Longest silence on a stream (the gateway sends keepalives every 15 s)."""
_STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)


class ApiError(Exception):
    """The gateway said no (``code``, ``status``: its problem document), or could not be
    reached or understood (``status`` 0). ``retriable``: the same call may succeed later."""

    def __init__(
        self, message: str, *, code: str = "error", status: int = 0, retriable: bool = False
    ) -> None:
        super().__init__(message)
        self.message, self.code, self.status, self.retriable = message, code, status, retriable


class Gateway:
    def __init__(
        self,
        url: str,
        api_key: str,
        *,
        accept: str,
        org_id: str | None = None,
        user_id: str | None = None,
        timeout: float = READ_TIMEOUT,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ApiError(f"the gateway URL must be an http(s) URL, not {url!r}")
        self.scheme, self.host, self.port = parts.scheme, parts.hostname, parts.port
        self.base = parts.path.rstrip("/")
        self.timeout = timeout
        self.headers = {"authorization": f"Bearer {api_key}", "user-agent": "sbx-client", "accept": accept}
        if org_id:
            self.headers["x-org-id"] = org_id
        if user_id:
            self.headers["x-user-id"] = user_id
        self._idle: http.client.HTTPConnection | None = None
        self._lock = threading.Lock()

    def session_path(self, session: str, tail: str = "", query: Mapping[str, object] | None = None) -> str:
        return self.path(f"/v1/sessions/{quote(session, safe='')}{tail}", query)

    def path(self, path: str, query: Mapping[str, object] | None = None) -> str:
        shown = {k: v for k, v in (query or {}).items() if v is not None}
        return f"{self.base}{path}" + (f"?{urlencode(shown, doseq=True)}" if shown else "")

    def connect(self, timeout: float | None = None) -> http.client.HTTPConnection:
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

    def request(
        self,
        method: str,
        path: str,
        body: bytes | Iterable[bytes] | None = None,
        content_type: str = "",
        headers: Mapping[str, str] | None = None,
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """Send; the connection and its response (status not yet checked). Give the
        connection back with :meth:`release` once the answer is read whole, else
        :meth:`discard` it."""
        sent = {**self.headers, **(headers or {})}
        if content_type:
            sent["content-type"] = content_type
        chunked = body is not None and not isinstance(body, bytes)
        if chunked:
            sent["transfer-encoding"] = "chunked"
        for attempt in range(2):
            with self._lock:
                conn, self._idle = self._idle, None
            reused = conn is not None
            if conn is None:
                conn = self.connect()
            try:
                conn.request(method, path, body=body, headers=sent, encode_chunked=chunked)
                return conn, conn.getresponse()
            except _STALE:
                conn.close()
                if not reused or chunked or attempt:
                    raise ApiError("the gateway closed the connection; the outcome is unknown") from None
            except OSError as exc:
                conn.close()
                raise ApiError(f"talking to the gateway failed: {exc}; the outcome is unknown") from None
        raise AssertionError("unreachable")

    def release(self, conn: http.client.HTTPConnection) -> None:
        """Keep ``conn`` (its answer read whole) for the next request."""
        with self._lock:
            if self._idle is None:
                self._idle = conn
                return
        conn.close()

    @staticmethod
    def discard(conn: http.client.HTTPConnection) -> None:
        conn.close()

    def close(self) -> None:
        with self._lock:
            conn, self._idle = self._idle, None
        if conn is not None:
            conn.close()


def check(conn: http.client.HTTPConnection, response: http.client.HTTPResponse) -> None:
    """Raise the error an error answer carries (its body read; the connection closed)."""
    if response.status < 400:
        return
    try:
        raw = response.read()
    except (OSError, http.client.HTTPException):
        raw = b""
    conn.close()
    raise problem_error(raw, response.status)


def problem_error(raw: bytes, status: int) -> ApiError:
    """The error in a problem document (or whatever came instead of one)."""
    try:
        problem = dict(json.loads(raw))
    except (ValueError, TypeError):
        shown = raw[:300].decode(errors="replace")
        return ApiError(f"HTTP {status}: {shown}" if status else shown or "error", status=status)
    return ApiError(
        str(problem.get("message", raw[:300].decode(errors="replace"))),
        code=str(problem.get("error", "error")),
        status=int(problem.get("status", status) or status),
        retriable=bool(problem.get("retriable")),
    )
