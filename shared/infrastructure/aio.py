"""asyncio helpers for living with client libraries.

nats-py can swallow a cancellation that lands inside some of its calls
(``fetch``, ``request``): the call returns or raises ``TimeoutError`` instead.
A loop would then never stop; such loops call :func:`raise_if_cancelling`
after every such call, and :func:`cancel_and_wait` cancels until tasks end.
"""

from __future__ import annotations

import asyncio


def raise_if_cancelling() -> None:
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def cancel_and_wait(tasks: list[asyncio.Task[object]], *, rounds: int = 20) -> None:
    """Cancel ``tasks`` and wait for them, re-cancelling any that absorbed a cancel."""
    pending = {t for t in tasks if not t.done()}
    for _ in range(rounds):
        if not pending:
            return
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=0.5)
