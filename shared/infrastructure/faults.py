"""Named crash points for fault-injection tests.

A test starts a real service process with ``SBX_FAULTS=<point>``; when the
process reaches that point it kills itself with SIGKILL, exactly as an OOM kill
or a node loss would, with no cleanup and no flush. With ``SBX_FAULTS`` unset
(always, in production) :func:`crash_point` does nothing.

Points in use:

``scheduler.after_append``    the event is in the stream, the projection not yet written.
``pool.after_runtime_start``  the sandbox runs, ``sandbox.started`` is not recorded.

Pause points (:func:`pause_point`) make a step slow instead, so a test can act while it
is in progress:

``pool.slow_pool_start``      a pool sandbox is recorded requested, then waits before it starts.
"""

from __future__ import annotations

import asyncio
import os
import signal

PAUSE_SECONDS = 3.0


def crash_point(enabled: frozenset[str], name: str) -> None:
    if name in enabled:
        os.kill(os.getpid(), signal.SIGKILL)


async def pause_point(enabled: frozenset[str], name: str) -> None:
    if name in enabled:
        await asyncio.sleep(PAUSE_SECONDS)
