"""The REST API from Python: sessions, a command's output as it comes, files as tar.

::

    from sbx_client import Client

    with Client() as api:                       # SBX_URL, SANDBOX_API_KEY (or a local sbx up)
        api.create_session("task-42")
        for event in api.run("task-42", "pytest -q"):
            ...                                  # Stdout, Stderr, then Exit
        print(api.execute("task-42", "ls").stdout)
        api.write_files("task-42", {"src/main.py": b"print(1)\\n"})
        api.delete_session("task-42")

A run streams NDJSON (:data:`~sbx_api.hostapi.RunEvent` a line); its last event is
:class:`~sbx_api.hostapi.Exit`, or the run failed and :class:`ApiError` is raised.
Leaving a run's iteration early closes its connection, which stops the command. Every
error answer is an :class:`ApiError` with the problem's code, status and ``retriable``.
"""

from __future__ import annotations

import http.client
import io
import os
import tarfile
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any, TypeVar
from urllib.parse import quote

import msgspec

from sbx_api import hostapi
from sbx_api import wire as api
from sbx_client import local
from sbx_client.connection import DEFAULT_URL, READ_TIMEOUT, ApiError, Gateway, check

T = TypeVar("T")
READ_SIZE = 256 * 1024
_EVENTS = msgspec.json.Decoder(hostapi.RunEvent)


@dataclass(frozen=True)
class Completed:
    """A finished run, its output collected (decoded as UTF-8; see :class:`hostapi.Stdout`)."""

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    duration: float
    sandbox_id: str


class Client:
    """A REST client for one gateway. Thread-safe; one kept-alive connection is reused,
    a stream in progress holds its own."""

    def __init__(
        self,
        url: str | None = None,
        api_key: str | None = None,
        *,
        org_id: str | None = None,
        user_id: str | None = None,
        timeout: float = READ_TIMEOUT,
        env: Mapping[str, str] | None = None,
    ) -> None:
        """``url`` and ``api_key`` default to ``SBX_URL`` and ``SANDBOX_API_KEY``, else to
        the local ``sbx up`` named by ``SBX_STATE_DIR``."""
        env = os.environ if env is None else env
        stack_dir = local.state_dir(None, env) if env.get("SBX_STATE_DIR") else None
        if stack_dir is not None:
            url = url or env.get("SBX_URL") or local.gateway_url(stack_dir)
            api_key = api_key or env.get("SANDBOX_API_KEY") or local.api_key(stack_dir)
        url = url or env.get("SBX_URL") or DEFAULT_URL
        api_key = api_key or env.get("SANDBOX_API_KEY")
        if not api_key:
            raise ApiError("no API key: pass api_key, or set SANDBOX_API_KEY (or SBX_STATE_DIR)")
        self.gateway = Gateway(
            url,
            api_key,
            accept=f"application/json, {hostapi.NDJSON}",
            org_id=org_id,
            user_id=user_id,
            timeout=timeout,
        )

    def close(self) -> None:
        self.gateway.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # ---- sessions -------------------------------------------------------------------------------

    def health(self) -> api.Health:
        return self._json("GET", self.gateway.path("/healthz"), api.Health)

    def create_session(
        self,
        session_id: str,
        *,
        image: str | None = None,
        org_id: str | None = None,
        user_id: str | None = None,
        idempotency_key: str | None = None,
    ) -> api.Session:
        """Register a session id (its sandbox starts with its first command)."""
        body = {"session_id": session_id, "image": image, "org_id": org_id, "user_id": user_id}
        return self._json(
            "POST",
            self.gateway.path("/v1/sessions"),
            api.Session,
            body={k: v for k, v in body.items() if v is not None},
            idempotency_key=idempotency_key or _key(),
        )

    def list_sessions(
        self,
        *,
        status: api.SessionStatus | None = None,
        org_id: str | None = None,
        user_id: str | None = None,
        image: str | None = None,
        limit: int | None = None,
        cursor: str | None = None,
    ) -> api.SessionList:
        """One page, oldest first; pass the answer's ``next_cursor`` (same filters) for the next."""
        query = {
            "status": status, "org_id": org_id, "user_id": user_id, "image": image,
            "limit": limit, "cursor": cursor,
        }  # fmt: skip
        return self._json("GET", self.gateway.path("/v1/sessions", query), api.SessionList)

    def get_session(self, session_id: str) -> api.Session:
        return self._json("GET", self.gateway.session_path(session_id), api.Session)

    def stop_session(self, session_id: str, *, idempotency_key: str | None = None) -> api.Session:
        """Stop its sandbox (idempotent); the session stays and starts again with its next command."""
        path = self.gateway.session_path(session_id, "/stop")
        return self._json("POST", path, api.Session, idempotency_key=idempotency_key or _key())

    def delete_session(self, session_id: str, *, idempotency_key: str | None = None) -> None:
        path = self.gateway.session_path(session_id)
        self._json("DELETE", path, None, idempotency_key=idempotency_key or _key())

    # ---- snapshots ------------------------------------------------------------------------------

    def snapshot(
        self, session_id: str, *, snapshot_id: str | None = None, idempotency_key: str | None = None
    ) -> api.Snapshot:
        """Snapshot the session's files (workspace, installed packages, shell directory and
        exports); its processes are frozen while they are copied."""
        body = {"snapshot_id": snapshot_id} if snapshot_id else {}
        path = self.gateway.session_path(session_id, "/snapshots")
        return self._json("POST", path, api.Snapshot, body=body, idempotency_key=idempotency_key or _key())

    def list_snapshots(
        self,
        *,
        session_id: str | None = None,
        status: api.SnapshotStatus | None = None,
        limit: int | None = None,
        cursor: str | None = None,
    ) -> api.SnapshotList:
        """One page, oldest first; pass the answer's ``next_cursor`` (same filters) for the next."""
        query = {"session_id": session_id, "status": status, "limit": limit, "cursor": cursor}
        return self._json("GET", self.gateway.path("/v1/snapshots", query), api.SnapshotList)

    def get_snapshot(self, snapshot_id: str) -> api.Snapshot:
        return self._json(
            "GET", self.gateway.path(f"/v1/snapshots/{quote(snapshot_id, safe='')}"), api.Snapshot
        )

    def delete_snapshot(self, snapshot_id: str, *, idempotency_key: str | None = None) -> None:
        """Delete it; sessions forked or restored from it keep their files."""
        path = self.gateway.path(f"/v1/snapshots/{quote(snapshot_id, safe='')}")
        self._json("DELETE", path, None, idempotency_key=idempotency_key or _key())

    def warm(self, snapshot_id: str, count: int) -> api.Snapshot:
        """Keep ``count`` idle sandboxes started from the snapshot ready (0: none), so that
        forks and restores of it claim one instead of starting one."""
        path = self.gateway.path(f"/v1/snapshots/{quote(snapshot_id, safe='')}/warm")
        return self._json("PUT", path, api.Snapshot, body={"count": count})

    def fork(
        self,
        snapshot_id: str,
        count: int | None = None,
        *,
        session_ids: list[str] | None = None,
        idempotency_key: str | None = None,
    ) -> api.Forks:
        """New sessions (``count``, or named by ``session_ids``) whose sandboxes start from the
        snapshot; the answer also lists those that could not be made, each with its reason."""
        body: dict[str, Any] = {"session_ids": session_ids} if session_ids else {"count": count or 1}
        path = self.gateway.path(f"/v1/snapshots/{quote(snapshot_id, safe='')}/forks")
        return self._json("POST", path, api.Forks, body=body, idempotency_key=idempotency_key or _key())

    def restore(
        self, session_id: str, snapshot_id: str, *, idempotency_key: str | None = None
    ) -> api.Session:
        """Put the session back to the snapshot: a new sandbox from it replaces the session's."""
        path = self.gateway.session_path(session_id, "/restore")
        body = {"snapshot_id": snapshot_id}
        return self._json("POST", path, api.Session, body=body, idempotency_key=idempotency_key or _key())

    # ---- runs -----------------------------------------------------------------------------------

    def run(
        self,
        session_id: str,
        command: str,
        *,
        cwd: str = hostapi.WORKSPACE,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> Iterator[hostapi.RunEvent]:
        """Run ``command`` (one shell command line) in the session's sandbox, starting it if
        needed: its events as they come (keepalives skipped), :class:`hostapi.Exit` last."""
        body = msgspec.json.encode(
            hostapi.RunBody(command=command, cwd=cwd, env=dict(env or {}), timeout=timeout)
        )
        conn, response = self.gateway.request(
            "POST", self.gateway.session_path(session_id, "/run"), body, "application/json"
        )
        check(conn, response)
        return self._events(conn, response)

    def execute(
        self,
        session_id: str,
        command: str,
        *,
        cwd: str = hostapi.WORKSPACE,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> Completed:
        """:meth:`run`, its output collected."""
        out: list[str] = []
        err: list[str] = []
        for event in self.run(session_id, command, cwd=cwd, env=env, timeout=timeout):
            if isinstance(event, hostapi.Stdout):
                out.append(event.data)
            elif isinstance(event, hostapi.Stderr):
                err.append(event.data)
            elif isinstance(event, hostapi.Exit):
                return Completed(
                    "".join(out),
                    "".join(err),
                    event.exit_code,
                    event.timed_out,
                    event.duration,
                    event.sandbox_id,
                )
        raise AssertionError("unreachable: a run ends with its exit or raises")

    def _events(
        self, conn: http.client.HTTPConnection, response: http.client.HTTPResponse
    ) -> Iterator[hostapi.RunEvent]:
        pending = b""
        done = False
        try:
            while chunk := response.read1(READ_SIZE):
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if not line.strip():
                        continue
                    event = _decode_event(line)
                    if isinstance(event, hostapi.Keepalive):
                        continue
                    if isinstance(event, hostapi.Failed):
                        raise ApiError(
                            event.message, code=event.error, status=event.status, retriable=event.retriable
                        )
                    if isinstance(event, hostapi.Exit):
                        response.read()
                        done = True
                    yield event
                    if done:
                        self.gateway.release(conn)
                        return
        except (OSError, http.client.HTTPException) as exc:
            raise ApiError(f"the stream from the gateway broke: {exc}; the outcome is unknown") from None
        finally:
            if not done:
                conn.close()  # left early, failed or broken: closing stops the command
        raise ApiError("the gateway closed the stream before the exit; the outcome is unknown")

    # ---- files ----------------------------------------------------------------------------------

    def upload(
        self, session_id: str, tar: bytes | Iterable[bytes], *, root: str = hostapi.WORKSPACE
    ) -> hostapi.ArchiveWritten:
        """Extract a tar (bytes, or chunks) under ``root`` in the session's sandbox."""
        path = self.gateway.session_path(session_id, "/archive", {"root": root})
        return self._json("PUT", path, hostapi.ArchiveWritten, raw=tar, content_type=hostapi.TAR_MEDIA_TYPE)

    def download(self, session_id: str, path: str, *, root: str = hostapi.WORKSPACE) -> Iterator[bytes]:
        """``path`` (relative to ``root``; a directory recursively) as tar chunks. A session
        with no sandbox has no files (404 ``not_found``): downloading never starts one."""
        url = self.gateway.session_path(session_id, "/archive", {"root": root, "path": path})
        conn, response = self.gateway.request("GET", url, headers={"accept": hostapi.TAR_MEDIA_TYPE})
        check(conn, response)
        return self._chunks(conn, response)

    def _chunks(
        self, conn: http.client.HTTPConnection, response: http.client.HTTPResponse
    ) -> Iterator[bytes]:
        done = False
        try:
            while chunk := response.read1(READ_SIZE):
                yield chunk
            done = True
        except (OSError, http.client.HTTPException) as exc:
            raise ApiError(f"the download broke: {exc}; what came is incomplete") from None
        finally:
            if done and response.isclosed():
                self.gateway.release(conn)
            else:
                conn.close()

    def write_files(
        self, session_id: str, files: Mapping[str, bytes | str], *, root: str = hostapi.WORKSPACE
    ) -> hostapi.ArchiveWritten:
        """Write these files (relative path: content; ``str`` as UTF-8), directories made as needed."""
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for name, content in files.items():
                data = content.encode() if isinstance(content, str) else content
                info = tarfile.TarInfo(hostapi.validate_relative(name))
                info.size, info.mode = len(data), 0o644
                tar.addfile(info, io.BytesIO(data))
        return self.upload(session_id, buffer.getvalue(), root=root)

    def read_file(self, session_id: str, path: str, *, root: str = hostapi.WORKSPACE) -> bytes:
        """One regular file's content (``ApiError`` ``invalid_input`` if it is not one)."""
        data = b"".join(self.download(session_id, path, root=root))
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            for member in tar:
                if PurePosixPath(member.name) == PurePosixPath(path):
                    extracted = tar.extractfile(member) if member.isfile() else None
                    if extracted is None:
                        break
                    return extracted.read()
        raise ApiError(f"{path!r} is not a regular file", code="invalid_input", status=400)

    # ---- plumbing -------------------------------------------------------------------------------

    def _json(
        self,
        method: str,
        path: str,
        answer: type[T] | None,
        *,
        body: Any = None,
        raw: bytes | Iterable[bytes] | None = None,
        content_type: str = "",
        idempotency_key: str | None = None,
    ) -> T:
        headers = {"accept": "application/json"}
        if idempotency_key is not None:
            headers["idempotency-key"] = idempotency_key
        elif method != "GET":
            headers["idempotency-key"] = (
                uuid.uuid4().hex
            )  # a retry of this call on a stale connection is one call
        if body is not None:
            raw, content_type = msgspec.json.encode(body), "application/json"
        conn, response = self.gateway.request(method, path, raw, content_type, headers)
        check(conn, response)
        try:
            data = response.read()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise ApiError(f"the answer broke: {exc}; the outcome is unknown") from None
        self.gateway.release(conn)
        if answer is None:
            return None  # type: ignore[return-value]
        try:
            return msgspec.json.decode(data, type=answer)
        except msgspec.DecodeError as exc:
            raise ApiError(f"the gateway's answer is not what the API says: {exc}") from None


def _key() -> str:
    """An Idempotency-Key of our own: a call sent again (a kept connection the gateway had
    closed) is still one call."""
    return uuid.uuid4().hex


def _decode_event(line: bytes) -> hostapi.RunEvent:
    try:
        return _EVENTS.decode(line)
    except msgspec.DecodeError as exc:
        raise ApiError(f"the gateway sent a malformed event: {exc}") from None
