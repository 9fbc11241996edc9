"""One line for people about any event (pure): what `sbx events` prints and the console's
audit stream shows, one rule for both; and sizes as people read them.

Most events say enough as their fields, ``name=value``; an egress record says it as the
summary its timeline entry has (where, verdict, why), not as a list of dictionaries.
"""

from __future__ import annotations

from shared.contract import codec, events
from shared.domain import egress

SKIPPED = frozenset(("meta", "type", "v"))


def line(event: events.Event) -> str:
    if isinstance(event, events.EgressRecorded):
        who = " ".join(
            f"{k}={v}" for k, v in (("session_id", event.session_id), ("sandbox_id", event.sandbox_id)) if v
        )
        return f"{who} proxy_id={event.proxy_id} {egress.summary(event)}".strip()
    fields = codec.to_builtins(event)
    return " ".join(f"{k}={v}" for k, v in fields.items() if k not in SKIPPED and v not in (None, "", [], {}))


def size(count: int) -> str:
    """Bytes in binary units, one decimal from KiB up (``512 B``, ``1.5 MiB``)."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            break
        value /= 1024
    return f"{count} B" if unit == "B" else f"{value:.1f} {unit}"
