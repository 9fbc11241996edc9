"""Named crash points for fault-injection tests.

A test starts a real service process with ``SBX_FAULTS=<point>``; when the
process reaches that point it kills itself with SIGKILL, exactly as an OOM kill
or a node loss would, with no cleanup and no flush. With ``SBX_FAULTS`` unset
(always, in production) :func:`crash_point` does nothing.

Points in use:

``scheduler.after_append``    the event is in the stream, the projection not yet written.
``pool.after_runtime_start``  the sandbox runs, ``sandbox.started`` is not recorded.
"""

from __future__ import annotations

import os
import signal


def crash_point(enabled: frozenset[str], name: str) -> None:
    if name in enabled:
        os.kill(os.getpid(), signal.SIGKILL)
