"""A service instance (one process of one service): its state fold."""

from __future__ import annotations

import msgspec

from sbx_api import errors
from shared.contract import events, states


def evolve(state: states.InstanceState | None, event: events.Event, seq: int) -> states.InstanceState:
    match event:
        case events.InstanceStarted():
            # A fixed SBX_INSTANCE_ID may start again (after a clean stop or a crash
            # that left no stop event): the new start replaces the old life.
            return states.InstanceState(
                service=event.service,
                instance=event.instance,
                status="running",
                pid=event.pid,
                host=event.host,
                version=event.version,
                started_at=event.meta.time,
                last_seq=seq,
            )
        case events.InstanceStopped() if state is not None and state.status == "running":
            return msgspec.structs.replace(state, status="stopped", stopped_at=event.meta.time, last_seq=seq)
        case _:
            raise errors.InvalidTransition(
                f"{events.tag_of(type(event))} at seq {seq} cannot follow "
                f"{state.status if state else 'nothing'} for an instance"
            )
