"""A session that floods the audit log is refused politely: real sandboxes, a real
nats-server, the executor with a small audit allowance. The refused call does not run and
says why and when it can go on; every call that ran has its record; other sessions go on."""

from __future__ import annotations

import pytest

from services.executor import app as executor_app
from services.pool_manager import app as pool_app
from services.scheduler import app as scheduler_app
from shared.contract import events, execution, subjects
from shared.domain import audit
from shared.infrastructure.settings import audit as audit_settings
from tests import support
from tests.integration.test_executor import RUNTIME, Client

pytestmark = [pytest.mark.needs_root("the local runtime needs root"), pytest.mark.slow]
ALLOWANCE = 64 * 1024
LIMITS = audit_settings.AuditRateSettings(bytes_per_window=ALLOWANCE, window=86400)
"""Refills less than a byte a second: nothing refills during the test."""


@pytest.fixture
async def stack(nats_server, namespace, tmp_path):
    state = tmp_path / "state"
    running = [
        await support.start_in_process(
            nats_server.url, namespace, "scheduler", scheduler_app.setup, state_dir=state
        ),
        await support.start_in_process(
            nats_server.url, namespace, "pool-manager", pool_app.make_setup(RUNTIME), state_dir=state
        ),
        await support.start_in_process(
            nats_server.url, namespace, "executor", executor_app.make_setup(RUNTIME, LIMITS), state_dir=state
        ),
    ]
    nc, topology = await support.connect(nats_server.url, namespace)
    yield Client(nc, topology)
    await nc.close()
    for r in reversed(running):
        await r.stop()
    from shared.runtime.local import runtime as local

    rt = local.LocalRuntime(state)
    for info in await rt.list():
        await rt.delete(info.sandbox_id)
    rt.caches.detach_all()


async def test_a_flood_of_command_text_is_refused_before_it_runs(stack):
    padding = "x" * 4056
    cost = audit.cost(f"touch /tmp/ran-000 # {padding}")  # 4589: 14 fit, 1290 bytes left over
    ran = 0
    while True:  # 4 KiB commands until the allowance is used up
        reply = await stack.run("flood", execution.Shell, command=f"touch /tmp/ran-{ran:03d} # {padding}")
        if not reply.ok:
            break
        ran += 1
        assert ran * cost <= ALLOWANCE, "never refused: no limit holds"
    assert ran == ALLOWANCE // cost
    assert reply.error.code == "limit_exceeded"  # 429, retriable, at the gateway
    message = reply.error.message
    assert message.startswith("not run: session 'flood' has used its audit allowance (64.0 KiB")
    assert "SBX_AUDIT_RATE" in message and "retry in " in message and message.endswith(" s")

    # A short command still fits what is left: the refused one did not run.
    listing = await stack.sh("flood", "ls /tmp")
    assert listing.output.split() == [f"ran-{n:03d}" for n in range(ran)]
    # Every call that ran is recorded, the refusal is not; another session goes on.
    assert (await stack.sh("other", "echo fine")).output == "fine\n"
    records = [
        s.event
        for s in await support.stream_events(stack.nc, stack.topology, subjects.EXEC)
        if isinstance(s.event, events.CommandExecuted) and s.event.session_id == "flood"
    ]
    assert [r.command.split(" #")[0] for r in records] == [
        *(f"touch /tmp/ran-{n:03d}" for n in range(ran)),
        "ls /tmp",
    ]
