"""What the pool-manager hears of its pools' use, from the followed sandboxes: when each
pool was claimed from (a pool being claimed from is not refilled yet: ``logic.held``)
and its recent demand, claims and the cold starts it could have served (a configured
pool is sized to it: ``shared.domain.poolsizing``)."""

from __future__ import annotations

import asyncio
import dataclasses
import time

from services.pool_manager import logic
from shared.contract import states
from shared.domain import pools as pool_specs
from shared.domain import poolsizing
from shared.infrastructure import metrics

CLAIMS_KEPT = 1000
"""Most pools whose claims are remembered (snapshots' pools come and go)."""


class Heard:
    def __init__(
        self, configured: list[pool_specs.PoolSpec], sizing: poolsizing.Sizing, wake: asyncio.Event
    ) -> None:
        self.configured = configured
        self.demand = poolsizing.Demand(sizing)
        self.wake = wake
        self.claimed: dict[str, logic.Claims] = {}
        """A pool id -> when its sandboxes were claimed (monotonic clock)."""

    def changed(self, old: states.SandboxState | None, new: states.SandboxState | None) -> None:
        """A sandbox's record changed (``None``: absent)."""
        if logic.leaves_room(old, new):
            self.wake.set()
        if old is not None and old.pool and logic.idle(old) and new is not None and new.session_id:
            self._claimed(old.pool, snapshot=old.snapshot is not None)
        elif (
            old is None and new is not None and new.status == "requested" and new.session_id and not new.pool
        ):
            # A cold start a configured pool could have served is demand it missed.
            fits = pool_specs.serving(self.configured, _options(new), None)
            if fits is not None:
                self.demand.add(fits.pool_id, time.monotonic())

    def _claimed(self, pool_id: str, *, snapshot: bool) -> None:
        now = time.monotonic()
        quiet = logic.SNAPSHOT_QUIET if snapshot else logic.CLAIM_QUIET
        if len(self.claimed) >= CLAIMS_KEPT:  # (pools long quiet are forgotten)
            for gone in [p for p, c in self.claimed.items() if now - c.last >= logic.SNAPSHOT_QUIET]:
                del self.claimed[gone]
        seen = self.claimed.get(pool_id)
        self.claimed[pool_id] = seen.after(now, quiet) if seen else logic.Claims(now, now)
        if not snapshot:
            self.demand.add(pool_id, now)
        # A held pool waits for its claims to stop coming: look again then.
        asyncio.get_running_loop().call_later(quiet, self.wake.set)

    def sized(self) -> list[pool_specs.PoolSpec]:
        """The configured pools, each at its floor plus its recent peak demand."""
        now = time.monotonic()
        out = []
        for spec in self.configured:
            peak = self.demand.peak(spec.pool_id, now)
            want = poolsizing.target(spec.min_idle, peak, self.demand.sizing)
            metrics.pool_demand.labels(spec.name).set(peak)
            metrics.pool_target.labels(spec.name).set(want)
            out.append(dataclasses.replace(spec, min_idle=want))
        return out


def _options(sandbox: states.SandboxState) -> dict[str, object]:
    """The options a session's own sandbox was made with, as a pool is matched against them."""
    return {
        "image": sandbox.image,
        "run_as_root": sandbox.run_as_root,
        "writable_root": sandbox.writable_root,
        "use_kata": sandbox.use_kata,
        "snapshot": sandbox.snapshot,
    }
