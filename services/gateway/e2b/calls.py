"""Envd calls as executor operations on the sandbox's session: one request answered, or
one streamed operation opened (through the host API's streams). The session's sandbox
is claimed or resumed as for any other call; every operation is audited by the executor
on the session's timeline (``exec.completed``)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable

from services.gateway import hostapi as host_api
from services.gateway import sessions
from shared.contract import execution, ids, states

BUDGET = 30.0
"""The executor's time for one short operation (its helper scripts' own bound)."""


def identity(session: states.SessionState) -> sessions.Identity:
    return sessions.Identity(
        session_id=session.session_id, correlation_id=ids.new_id(), org_id=session.org_id, via="rest"
    )


async def call(
    host: host_api.HostAPI,
    session: states.SessionState,
    build: Callable[..., execution.AnyRequest],
    budget: float = BUDGET,
) -> execution.Reply:
    """One executor request for the session's sandbox; its reply (an error is raised)."""
    who = identity(session)

    async def run(sandbox_id: str) -> execution.Reply:
        request = build(**host.resolver.request_fields(who, sandbox_id))
        return await host.executor.run(request, budget=budget)

    return await host.resolver.with_sandbox(who, run)


async def stream(
    host: host_api.HostAPI, session: states.SessionState, build: Callable[..., execution.AnyRequest]
) -> tuple[AsyncGenerator[tuple[bytes, bytes], None], execution.Reply]:
    """Open a streamed operation: its frames as (channel, data), keepalives included, and
    the executor's reply (where to send input, for an upload). Closing the frames before
    their end stops the operation."""
    receiver, run_id, _, reply = await host.open(identity(session), build)
    stop = host.topology.exec_stop(session.session_id, run_id)
    return host.events(receiver, stop), reply
