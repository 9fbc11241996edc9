"""Request/reply between services: one typed server side and one typed client per
command family.

A :class:`Family` says what crosses one request subject: how a request and its reply
decode, who answers, how a failure is written as a reply. The server side is
:func:`answer` (decode, call, map errors, encode); the client side is :class:`Client`
and its typed subclasses (send, decode, raise the reply's error). Every reply carries
``ok`` and ``error``; an error reply becomes the product's error again on the caller's
side (:func:`sbx_api.errors.from_code`), so a caller sees the same error the
responder raised. Responders beat while they hold a request (:mod:`shared.infrastructure.beats`, served by
:mod:`shared.infrastructure.responders`): a caller whose responder died hears so within seconds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import msgspec
import structlog
from nats.aio.client import Client as Nats

from sbx_api import errors
from shared.contract import codec, commands, execution, provisioning, states, subjects
from shared.infrastructure import beats, tracing

log = structlog.get_logger(__name__)


Req = TypeVar("Req", bound=msgspec.Struct)
Rep = TypeVar("Rep", commands.CommandReply, provisioning.PoolReply, execution.Reply)
"""Every reply carries ``ok`` and ``error``."""


@dataclass(frozen=True)
class Family(Generic[Req, Rep]):
    """One request subject and what crosses it."""

    what: str
    """What a request is called in errors (``session command``)."""
    responder: str
    """Who answers, as errors name it (``scheduler``)."""
    subject: Callable[[subjects.Topology], str]
    decode: Callable[[bytes], Req]
    decode_reply: Callable[[bytes], Rep]
    failed: Callable[[commands.ErrorInfo], Rep]
    """The error reply."""
    timeout: float
    """How long a caller waits by default, in seconds."""


def _prepare(raw: bytes) -> execution.Prepare:
    return msgspec.json.decode(raw, type=execution.Prepare)


def _jobs(raw: bytes) -> execution.Jobs:
    return msgspec.json.decode(raw, type=execution.Jobs)


PROVISION_TIMEOUT = 900.0
"""How long session commands and pool requests may take: a new sandbox may need its image
pulled first (SBX_IMAGE_PULL_TIMEOUT, 10 minutes by default). A responder that dies is
noticed within seconds all the same (its beats stop)."""

SESSIONS: Family[commands.SessionCommand, commands.CommandReply] = Family(
    "session command",
    "scheduler",
    lambda t: t.session_commands,
    codec.decode_command,
    codec.decode_reply,
    lambda e: commands.CommandReply(ok=False, error=e),
    PROVISION_TIMEOUT,
)
POOL: Family[provisioning.AnyPoolRequest, provisioning.PoolReply] = Family(
    "pool request",
    "pool-manager",
    lambda t: t.pool_requests,
    provisioning.decode_request,
    provisioning.decode_reply,
    lambda e: provisioning.PoolReply(ok=False, error=e),
    PROVISION_TIMEOUT,
)
EXEC: Family[execution.AnyRequest, execution.Reply] = Family(
    "execution request",
    "executor",
    lambda t: t.exec_requests,
    execution.decode_request,
    execution.decode_reply,
    lambda e: execution.Reply(ok=False, error=e),
    60.0,
)
PREPARE: Family[execution.Prepare, execution.Reply] = Family(
    "prepare request",
    "executor",
    lambda t: t.exec_prepare,
    _prepare,
    execution.decode_reply,
    lambda e: execution.Reply(ok=False, error=e),
    30.0,
)
JOBS: Family[execution.Jobs, execution.Reply] = Family(
    "jobs request",
    "executor",
    lambda t: t.exec_jobs,
    _jobs,
    execution.decode_reply,
    lambda e: execution.Reply(ok=False, error=e),
    30.0,
)


# ---- the server side ---------------------------------------------------------------------


def decode(family: Family[Req, Rep], raw: bytes) -> Req:
    """The request, or InvalidInput saying what was malformed (never trust the bus). The
    request's span (the responder's, if traced) is named after it."""
    try:
        request = family.decode(raw)
    except Exception as exc:
        raise errors.InvalidInput(f"malformed {family.what}: {exc}") from exc
    tracing.describe(family.responder, request)
    return request


def error_info(exc: Exception, crashed: str) -> commands.ErrorInfo:
    """What a reply says of a failure: the product's errors as they are; anything else is
    logged (as ``crashed``) and answered "internal", naming only the exception's type."""
    if isinstance(exc, errors.SandboxError):
        return commands.ErrorInfo(exc.code, exc.message)
    log.exception(crashed)
    return commands.ErrorInfo("internal", f"internal error: {type(exc).__name__}")


async def answer(
    family: Family[Req, Rep],
    raw: bytes,
    handle: Callable[[Req], Awaitable[Rep]],
    *,
    crashed: str,
    on_error: Callable[[commands.ErrorInfo], None] | None = None,
) -> bytes:
    """Answer one request: every failure becomes an error reply, never a crash."""
    try:
        reply = await handle(decode(family, raw))
    except Exception as exc:
        info = error_info(exc, crashed)
        if on_error is not None:
            on_error(info)
        reply = family.failed(info)
    tracing.settle(reply)
    return codec.encode(reply)


# ---- the client side ---------------------------------------------------------------------


class Client(Generic[Req, Rep]):
    """Requests of one family; ``timeout`` overrides the family's default."""

    def __init__(
        self, nc: Nats, topology: subjects.Topology, family: Family[Req, Rep], timeout: float | None = None
    ) -> None:
        self.nc = nc
        self.topology = topology
        self.family: Family[Req, Rep] = family
        self.timeout = family.timeout if timeout is None else timeout

    async def ask(
        self,
        request: Req,
        *,
        timeout: float | None = None,
        on_progress: Callable[[str], Awaitable[None]] | None = None,
    ) -> Rep:
        """The reply, whether it says ok or not (unreachable responders raise)."""
        subject = self.family.subject(self.topology)
        with tracing.requesting(self.family.responder, subject, request):
            raw = await beats.for_connection(self.nc).request(
                subject,
                codec.encode(request),
                timeout=self.timeout if timeout is None else timeout,
                who=self.family.responder,
                on_progress=on_progress,
            )
            reply = self.family.decode_reply(raw)
            tracing.settle(reply)
            return reply

    async def call(
        self,
        request: Req,
        *,
        timeout: float | None = None,
        on_progress: Callable[[str], Awaitable[None]] | None = None,
    ) -> Rep:
        """The reply of a request that succeeded; a failed one raises its error."""
        reply = await self.ask(request, timeout=timeout, on_progress=on_progress)
        if not reply.ok:
            error = reply.error or commands.ErrorInfo("internal", f"the {self.family.responder} failed")
            raise errors.from_code(error.code, error.message)
        return reply


class SessionClient(Client[commands.SessionCommand, commands.CommandReply]):
    """Session commands to the scheduler."""

    def __init__(self, nc: Nats, topology: subjects.Topology, timeout: float | None = None) -> None:
        super().__init__(nc, topology, SESSIONS, timeout)

    async def session(
        self, command: commands.SessionCommand, *, timeout: float | None = None
    ) -> states.SessionState | None:
        """Send a session command; return the resulting state or raise its error.
        ``timeout``: this call's wait instead of the client's."""
        return (await self.call(command, timeout=timeout)).session


class PoolClient(Client[provisioning.AnyPoolRequest, provisioning.PoolReply]):
    """Provisioning requests to the pool-manager (which alone drives the runtime)."""

    def __init__(self, nc: Nats, topology: subjects.Topology, timeout: float | None = None) -> None:
        super().__init__(nc, topology, POOL, timeout)

    async def send(self, request: provisioning.AnyPoolRequest) -> states.SandboxState | None:
        return (await self.call(request)).sandbox


class ExecClient(Client[execution.AnyRequest, execution.Reply]):
    """Requests to the executor. ``budget`` is the request's own time; a margin is added."""

    MARGIN = 10.0

    def __init__(self, nc: Nats, topology: subjects.Topology) -> None:
        super().__init__(nc, topology, EXEC)
        self._cancels: set[asyncio.Task[None]] = set()

    async def run(
        self,
        request: execution.AnyRequest,
        *,
        budget: float,
        on_progress: Callable[[str], Awaitable[None]] | None = None,
    ) -> execution.Reply:
        """Send one request; return the reply, or raise its error. Cancelled (the caller's
        client cancelled or went away): the executor is told to stop the call.
        ``on_progress`` gets what the executor says of the call's progress while it runs."""
        try:
            return await self.call(request, timeout=budget + self.MARGIN, on_progress=on_progress)
        except asyncio.CancelledError:
            if request.call_id is not None:
                self.cancel(request.session_id, request.call_id)
            raise

    def cancel(self, session_id: str, call_id: str) -> None:
        """Tell the executors to stop this call, if one runs it (sent in the background:
        the caller may be in a cancelled scope, where every await is cancelled)."""
        subject = self.topology.exec_cancel(session_id, call_id)
        task = asyncio.get_running_loop().create_task(self.nc.publish(subject, b""))
        self._cancels.add(task)  # a reference until it is sent
        task.add_done_callback(self._cancels.discard)
