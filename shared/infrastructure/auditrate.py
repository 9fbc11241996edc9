"""Each session's audit-rate allowance, kept in the ``<ns>_audit_rate`` bucket so every
executor instance charges the same bucket (the rule: :mod:`shared.domain.audit`)."""

from __future__ import annotations

import time

import msgspec
import nats.js.errors
from nats.js.kv import KeyValue

from sbx_api import errors
from shared.contract import codec, ids
from shared.domain import audit
from shared.infrastructure import bounded, eventstore
from shared.infrastructure.settings import audit as audit_settings

ROUNDS = 20
"""Charges of one session racing each other: each CAS loser reads again, this many times."""
REMEMBERED = 10_000
"""Sessions whose entry (and its revision) this instance wrote last and remembers."""


class AuditRate:
    def __init__(self, kv: KeyValue, limits: audit_settings.AuditRateSettings) -> None:
        self.kv = kv
        self.limits = limits
        self._written: bounded.Bounded[str, tuple[audit.Level, int]] = bounded.Bounded(REMEMBERED)
        """What this instance wrote last per session: its next charge tries a CAS on it at
        once (one round trip); if another executor wrote since, the CAS fails and it reads."""

    @property
    def on(self) -> bool:
        return self.limits.bytes_per_window > 0

    async def charge(self, session_id: str, amount: int, *, now: float | None = None) -> None:
        """Take ``amount`` from the session's allowance, or raise LimitExceeded saying when
        the call can go on."""
        if not self.on:
            return
        key = ids.token(session_id)
        for attempt in range(ROUNDS):
            remembered = self._written.pop(key, None) if attempt == 0 else None
            level, revision = remembered if remembered is not None else await self._read(key)
            decided = audit.charge(
                level,
                amount,
                time.time() if now is None else now,
                allowance=self.limits.bytes_per_window,
                window=self.limits.window,
            )
            if isinstance(decided, audit.Refused):
                if remembered is not None:  # (an older level refuses only if the newest would)
                    self._written[key] = remembered
                raise errors.LimitExceeded(
                    audit.refusal(
                        session_id, decided, allowance=self.limits.bytes_per_window, window=self.limits.window
                    )
                )
            try:
                if revision is None:
                    written = await self.kv.create(key, codec.encode(decided))
                else:
                    written = await self.kv.update(key, codec.encode(decided), last=revision)
            except nats.js.errors.KeyWrongLastSequenceError:
                continue  # another call of this session charged first: look again
            except Exception as exc:
                raise eventstore.translate(exc, "charging the audit allowance") from exc
            self._written[key] = (decided, written)
            return
        raise errors.ConcurrencyError(f"session {session_id!r}: its audit allowance kept changing")

    async def _read(self, key: str) -> tuple[audit.Level | None, int | None]:
        try:
            entry = await self.kv.get(key)
        except nats.js.errors.KeyNotFoundError:
            return None, None
        except Exception as exc:
            raise eventstore.translate(exc, "reading the audit allowance") from exc
        if not entry.value:  # deleted (or expired) and not yet written again
            return None, entry.revision
        try:
            return codec.decode_state(entry.value, audit.Level), entry.revision
        except (msgspec.DecodeError, msgspec.ValidationError, errors.CorruptEvent):
            return None, entry.revision  # unreadable: counted as a full allowance, then overwritten
