"""The gateway's fast path: where a session runs (services.gateway.placement), and how a
stale answer falls back to the scheduler (services.gateway.mcp)."""

from __future__ import annotations

from datetime import UTC, datetime

import fastmcp
import msgspec

from sbx_api import errors
from services.gateway import mcp as mcp_tools
from services.gateway import placement
from shared.contract import execution, states
from tests import factories
from tests.unit.test_mcp_tools import HEADERS, SESSION, FakeCommands, _state

NOW = datetime(2026, 1, 1, tzinfo=UTC)


class Store:
    """A projection store reduced to what Placement reads; counts the reads."""

    def __init__(self, items: dict) -> None:
        self.items, self.reads = items, 0

    async def get(self, key: str):
        self.reads += 1
        return self.items.get(key)


def sandbox(sandbox_id: str, status: str = "running") -> states.SandboxState:
    return factories.sandbox_state(sandbox_id, status, session_id=SESSION, created_at=NOW, updated_at=NOW)


async def test_a_running_placement_is_remembered_briefly_and_can_be_forgotten(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(placement.time, "monotonic", lambda: clock[0])
    sessions, sandboxes = Store({SESSION: _state("sb-1")}), Store({"sb-1": sandbox("sb-1")})
    where = placement.Placement(sessions, sandboxes, ttl=2.0)
    assert await where.running_sandbox(SESSION) == "sb-1"
    assert await where.running_sandbox(SESSION) == "sb-1"
    assert sessions.reads == 1, "the second call within the TTL reads nothing"
    clock[0] += 2.5
    assert await where.running_sandbox(SESSION) == "sb-1" and sessions.reads == 2
    where.forget(SESSION)
    assert await where.running_sandbox(SESSION) == "sb-1" and sessions.reads == 3


async def test_only_active_sessions_on_running_sandboxes_take_the_fast_path():
    stopped_session = msgspec.structs.replace(_state("sb-1"), status="stopped")
    cases = [
        (Store({}), Store({})),
        (Store({SESSION: stopped_session}), Store({"sb-1": sandbox("sb-1")})),
        (Store({SESSION: _state(None)}), Store({})),
        (Store({SESSION: _state("sb-1")}), Store({"sb-1": sandbox("sb-1", "stopped")})),
        (Store({SESSION: _state("sb-1")}), Store({})),
    ]
    for sessions, sandboxes in cases:
        assert await placement.Placement(sessions, sandboxes).running_sandbox(SESSION) is None


class RefusingOnce:
    """An executor that refuses the stale sandbox the way the real one does."""

    def __init__(self) -> None:
        self.sandboxes: list[str] = []

    async def run(self, request: execution.AnyRequest, *, budget: float, on_progress=None) -> execution.Reply:
        self.sandboxes.append(request.sandbox_id)
        if request.sandbox_id == "stale":
            raise errors.NotRunning("sandbox stale is stopped, not running")
        return execution.Reply(ok=True, output="fine\n", exit_code=0)


async def test_a_stale_placement_is_forgotten_and_the_scheduler_answers():
    forgotten: list[str] = []

    async def running_sandbox(session_id: str, org_id: str | None = None) -> str | None:
        return "stale"

    executor = RefusingOnce()
    commands = FakeCommands(_state("fresh"))
    mcp = mcp_tools.build_mcp(
        commands,  # type: ignore[arg-type]
        executor,  # type: ignore[arg-type]
        headers=lambda: HEADERS,
        running_sandbox=running_sandbox,
        forget=forgotten.append,
    )
    async with fastmcp.Client(mcp) as client:
        result = await client.call_tool("shell", {"command": "true"}, raise_on_error=False)
    assert not result.is_error and "fine" in result.content[0].text
    assert executor.sandboxes == ["stale", "fresh"]
    assert forgotten == [SESSION] and len(commands.sent) == 1


async def test_a_caller_for_another_organisation_never_takes_the_fast_path():
    """The placement knows the session's organisation: a caller acting for another one is
    sent to the scheduler (which refuses), even from the remembered answer."""
    owned = msgspec.structs.replace(_state("sb-1"), org_id="acme")
    where = placement.Placement(Store({SESSION: owned}), Store({"sb-1": sandbox("sb-1")}))
    assert await where.running_sandbox(SESSION, "globex") is None
    assert await where.running_sandbox(SESSION, "acme") == "sb-1"
    assert await where.running_sandbox(SESSION, "globex") is None  # remembered, still refused
    assert await where.running_sandbox(SESSION) == "sb-1"  # the operator


async def test_the_schedulers_answer_is_remembered_so_the_first_tool_call_reads_nothing():
    """A session's first request goes to the scheduler (a new session has no placement);
    the answer is remembered, so the call right after it (an agent's first tool call after
    connecting) reads no projection, and the organisation rule still holds for it."""
    from services.gateway import sessions as gateway_sessions

    owned = msgspec.structs.replace(_state("sb-9"), org_id="acme")
    session_store, sandbox_store = Store({}), Store({})
    where = placement.Placement(session_store, sandbox_store)
    scheduler = FakeCommands(owned)
    resolver = gateway_sessions.Resolver(
        scheduler,  # type: ignore[arg-type]
        where.running_sandbox,
        where.forget,
        where.remember,
    )
    who = gateway_sessions.Identity(session_id=SESSION, correlation_id="c1", org_id="acme")
    assert await resolver.sandbox_for(who) == "sb-9"
    reads = session_store.reads
    assert await resolver.sandbox_for(who) == "sb-9"
    assert session_store.reads == reads and sandbox_store.reads == 0 and len(scheduler.sent) == 1
    assert await where.running_sandbox(SESSION, "globex") is None
