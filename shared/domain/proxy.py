"""A proxy of the credential-proxy fleet: its state fold."""

from __future__ import annotations

import msgspec

from sbx_api import errors
from shared.contract import events, states


def evolve(state: states.ProxyState | None, event: events.Event, seq: int) -> states.ProxyState:
    status = state.status if state else None
    match event:
        case events.ProxyStarted() if state is None:
            return states.ProxyState(
                proxy_id=event.proxy_id,
                status="running",
                backend=event.backend,
                endpoint=event.endpoint,
                started_at=event.meta.time,
                updated_at=event.meta.time,
                last_seq=seq,
            )
        case events.ProxyDraining() if status == "running":
            assert state is not None
            return msgspec.structs.replace(state, status="draining", updated_at=event.meta.time, last_seq=seq)
        case events.ProxyStopped() if status in ("running", "draining"):
            assert state is not None
            return msgspec.structs.replace(
                state, status="stopped", stop_reason=event.reason, updated_at=event.meta.time, last_seq=seq
            )
    raise errors.InvalidTransition(
        f"{events.tag_of(type(event))} at seq {seq} cannot follow {status or 'nothing'} for a proxy"
    )


def decide(state: states.ProxyState | None, event: events.Event) -> list[events.Event]:
    """Record ``event`` for a proxy iff it follows what the proxy is: started once, drained
    while running, stopped while running or draining (a repeat is a no-op)."""
    status = state.status if state else None
    match event:
        case events.ProxyStarted():
            return [event] if state is None else []
        case events.ProxyDraining():
            return [event] if status == "running" else []
        case events.ProxyStopped():
            return [event] if status in ("running", "draining") else []
    return []
