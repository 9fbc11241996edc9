"""The host API as :class:`Sandbox` uses it (:mod:`sbx_api.hostapi`, frames): run a
command with streamed output, upload a tar, download paths, stop a run, release a session.

One operation at a time per ``Transport``, on :class:`~sbx_client.connection.Gateway`'s
kept-alive connection. Every answer is read as frames (asked for with ``Accept``;
keepalive frames are skipped); an error frame or an error status becomes
:class:`ApiError` with the gateway's message.
"""

from __future__ import annotations

import http.client
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import msgspec

from sbx_api import errors, hostapi
from sbx_client.connection import (
    CONNECT_TIMEOUT,
    DEFAULT_URL,
    READ_TIMEOUT,
    ApiError,
    Gateway,
    check,
    problem_error,
)

__all__ = ["DEFAULT_URL", "Answer", "ApiError", "Output", "Transport"]

READ_SIZE = 256 * 1024


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
        self.gateway = Gateway(
            url,
            api_key,
            accept=f"{hostapi.MEDIA_TYPE}, application/json",
            org_id=org_id,
            user_id=user_id,
            timeout=timeout,
        )
        self._lock = threading.Lock()
        self.current_run: tuple[str, str] | None = None
        """(session, run id) of the run streaming now: what :meth:`stop` stops."""

    def close(self) -> None:
        self.gateway.close()

    def _path(self, session: str, tail: str) -> str:
        return self.gateway.session_path(session, tail)

    def _request(
        self, method: str, path: str, body: bytes | Iterable[bytes] | None = None, content_type: str = ""
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        conn, response = self.gateway.request(method, path, body, content_type)
        check(conn, response)
        return conn, response

    # ---- operations ---------------------------------------------------------------------------

    def run(self, session: str, body: hostapi.RunBody, output: Output) -> Answer:
        with self._lock:
            conn, response = self._request(
                "POST", self._path(session, "/run"), msgspec.json.encode(body), "application/json"
            )
            self.current_run = (session, response.getheader("x-run-id", ""))
            try:
                return self._frames(conn, response, output, None)
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
            conn = self.gateway.connect(CONNECT_TIMEOUT)
            try:
                conn.request(
                    "POST", self._path(session, f"/runs/{run_id}/stop"), headers=self.gateway.headers
                )
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
            conn, response = self._request(
                "POST", self._path(session, "/files/put"), body(), hostapi.MEDIA_TYPE
            )
            return self._frames(conn, response, None, None)

    def get(self, session: str, root: str, paths: list[str], tar: Callable[[bytes], None]) -> Answer:
        body = msgspec.json.encode(hostapi.GetBody(root=root, paths=paths))
        with self._lock:
            conn, response = self._request(
                "POST", self._path(session, "/files/get"), body, "application/json"
            )
            return self._frames(conn, response, None, tar)

    def release(self, session: str) -> bool:
        """Delete the session and its sandbox; False if there was none."""
        with self._lock:
            conn, response = self.gateway.request("DELETE", self._path(session, ""))
            if response.status == 404:
                response.read()
                self.gateway.release(conn)
                return False
            check(conn, response)
            response.read()
            self.gateway.release(conn)
            return True

    # ---- reading answers ----------------------------------------------------------------------

    def _frames(
        self,
        conn: http.client.HTTPConnection,
        response: http.client.HTTPResponse,
        output: Output | None,
        tar: Callable[[bytes], None] | None,
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
                        if len(listing) > hostapi.LISTING_MAX:
                            raise ApiError(
                                f"the sandbox's listing is larger than {hostapi.LISTING_MAX} bytes"
                            )
                    elif channel == hostapi.TAR and tar is not None:
                        tar(data)
                    elif channel == hostapi.END:
                        response.read()  # the rest (nothing): the connection can be reused
                        self.gateway.release(conn)
                        return _answer(response, data, bytes(listing))
                    elif channel == hostapi.ERROR:
                        response.read()
                        self.gateway.release(conn)
                        raise problem_error(data, 0)
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise ApiError(f"the stream from the gateway broke: {exc}; the outcome is unknown") from None
        except errors.InvalidInput as exc:  # a malformed frame
            conn.close()
            raise ApiError(f"the gateway sent a malformed stream: {exc.message}") from None
        except BaseException:
            conn.close()
            raise
        conn.close()
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
