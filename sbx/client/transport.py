"""The host API over HTTP (:mod:`shared.hostapi`): run a command with streamed output,
upload a tar, download paths, stop a run, release a session.

Synchronous (httpx), because the agent-facing surface (``sbx exec``, ``Sandbox``) is.
Every answer is read as frames; an error frame or an error status becomes
:class:`ApiError` with the gateway's message.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import httpx
import msgspec

from shared import hostapi

DEFAULT_URL = "http://127.0.0.1:8080"
CONNECT_TIMEOUT = 10.0
READ_TIMEOUT = 90.0
"""Longest silence on a stream (the executor sends heartbeats every few seconds)."""


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
    extra: dict[str, str] = field(default_factory=dict)


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
        client: httpx.Client | None = None,
    ) -> None:
        headers = {"authorization": f"Bearer {api_key}"}
        if org_id:
            headers["x-org-id"] = org_id
        if user_id:
            headers["x-user-id"] = user_id
        self.url = url.rstrip("/")
        self.http = client or httpx.Client(
            headers=headers,
            timeout=httpx.Timeout(READ_TIMEOUT, connect=CONNECT_TIMEOUT),
        )
        if client is not None:
            self.http.headers.update(headers)
        self.current_run: tuple[str, str] | None = None
        """(session, run id) of the run streaming now: what :meth:`stop` stops."""

    def close(self) -> None:
        self.http.close()

    def _path(self, session: str, tail: str) -> str:
        from urllib.parse import quote

        return f"{self.url}/v1/sessions/{quote(session, safe='')}{tail}"

    # ---- operations ---------------------------------------------------------------------------

    def run(self, session: str, body: hostapi.RunBody, output: Output) -> Answer:
        with self.http.stream(
            "POST",
            self._path(session, "/run"),
            content=msgspec.json.encode(body),
            headers={"content-type": "application/json"},
        ) as response:
            self._check(response)
            self.current_run = (session, response.headers.get("x-run-id", ""))
            try:
                return self._frames(response, output, None)
            finally:
                self.current_run = None

    def stop(self) -> None:
        """Stop the run streaming now (from another thread, e.g. on Ctrl-C)."""
        current = self.current_run
        if current is None or not current[1]:
            return
        session, run_id = current
        try:
            self.http.post(self._path(session, f"/runs/{run_id}/stop"), timeout=CONNECT_TIMEOUT)
        except httpx.HTTPError:
            pass  # closing the stream stops it too

    def put(self, session: str, params: hostapi.PutParams, tar: Iterable[bytes]) -> Answer:
        def body() -> Iterator[bytes]:
            yield hostapi.frame(hostapi.PARAMS, msgspec.json.encode(params))
            for chunk in tar:
                yield hostapi.frame(hostapi.TAR, chunk)

        with self.http.stream("POST", self._path(session, "/files/put"), content=body()) as response:
            self._check(response)
            return self._frames(response, None, None)

    def get(self, session: str, root: str, paths: list[str], tar: Callable[[bytes], None]) -> Answer:
        body = msgspec.json.encode(hostapi.GetBody(root=root, paths=paths))
        with self.http.stream(
            "POST",
            self._path(session, "/files/get"),
            content=body,
            headers={"content-type": "application/json"},
        ) as response:
            self._check(response)
            return self._frames(response, None, tar)

    def release(self, session: str) -> bool:
        """Delete the session and its sandbox; False if there was none."""
        response = self.http.delete(self._path(session, ""))
        if response.status_code == 404:
            return False
        self._check(response)
        return True

    # ---- reading answers ----------------------------------------------------------------------

    @staticmethod
    def _check(response: httpx.Response) -> None:
        if response.status_code < 400:
            return
        response.read()
        try:
            problem = json.loads(response.content)
            raise ApiError(
                problem.get("message", response.text),
                code=problem.get("error", "error"),
                status=response.status_code,
                retriable=bool(problem.get("retriable")),
            )
        except (ValueError, AttributeError):
            raise ApiError(
                f"HTTP {response.status_code}: {response.text[:300]}", status=response.status_code
            ) from None

    @staticmethod
    def _frames(
        response: httpx.Response, output: Output | None, tar: Callable[[bytes], None] | None
    ) -> Answer:
        reader = hostapi.FrameReader()
        listing = bytearray()
        for chunk in response.iter_bytes():
            for channel, data in reader.feed(chunk):
                if channel in (hostapi.STDOUT, hostapi.STDERR) and output is not None:
                    output(channel, data)
                elif channel == hostapi.LISTING:
                    listing += data
                elif channel == hostapi.TAR and tar is not None:
                    tar(data)
                elif channel == hostapi.END:
                    return Answer(
                        end=msgspec.json.decode(data, type=hostapi.End),
                        listing=bytes(listing),
                        sandbox_id=response.headers.get("x-sandbox-id", ""),
                        run_id=response.headers.get("x-run-id", ""),
                    )
                elif channel == hostapi.ERROR:
                    problem = json.loads(data)
                    raise ApiError(
                        problem.get("message", "error"),
                        code=problem.get("error", "error"),
                        status=int(problem.get("status", 500)),
                        retriable=bool(problem.get("retriable")),
                    )
        raise ApiError("the gateway closed the stream before the end frame; the outcome is unknown")
