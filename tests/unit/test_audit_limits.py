"""The audit limits' rules (shared.domain.audit) and their settings."""

from __future__ import annotations

import pytest

from sbx_api import errors
from shared.domain import audit
from shared.infrastructure.settings import audit as audit_settings
from shared.infrastructure.settings import bus

ALLOWANCE, WINDOW = 10_000, 100.0  # drains 100 bytes a second


def charged(level, amount, now):
    return audit.charge(level, amount, now, allowance=ALLOWANCE, window=WINDOW)


# ---- the rate ----------------------------------------------------------------------


def test_a_session_may_cause_its_allowance_at_once_and_no_more():
    level = None
    for _ in range(10):
        level = charged(level, 1000, now=0.0)
        assert isinstance(level, audit.Level)
    refused = charged(level, 1, now=0.0)
    assert isinstance(refused, audit.Refused) and refused.wait == pytest.approx(0.01)


def test_the_allowance_refills_evenly_and_the_wait_said_is_the_wait_needed():
    full = audit.Level(used=ALLOWANCE, at=0.0)
    refused = charged(full, 2500, now=5.0)  # 500 drained: 2000 short
    assert isinstance(refused, audit.Refused) and refused.wait == pytest.approx(20.0)
    assert isinstance(charged(full, 2500, now=5.0 + refused.wait - 0.5), audit.Refused)
    assert isinstance(charged(full, 2500, now=5.0 + refused.wait), audit.Level)
    assert charged(full, 10, now=1000.0) == audit.Level(used=10, at=1000.0)  # never below empty


def test_a_clock_that_goes_back_refills_nothing():
    level = audit.Level(used=ALLOWANCE, at=50.0)
    assert isinstance(charged(level, 1, now=10.0), audit.Refused)


def test_a_call_costs_its_recorded_text_in_bytes_plus_a_record():
    assert audit.cost("") == audit.RECORD_OVERHEAD
    assert audit.cost("ls") == 2 + audit.RECORD_OVERHEAD
    assert audit.cost("é" * 10) == 20 + audit.RECORD_OVERHEAD


def test_a_refusal_says_what_why_and_when():
    said = audit.refusal("s-1", audit.Refused(wait=41.2, used=9000), allowance=4 * 1024**2, window=600)
    assert said.startswith("not run: session 's-1'")
    assert "4.0 MiB" in said and "per 10 min" in said and "SBX_AUDIT_RATE" in said
    assert said.endswith("retry in 42 s")


# ---- the byte limit -----------------------------------------------------------------


def test_nothing_is_trimmed_below_ninety_percent():
    assert audit.trim_below(used=899, limit=1000, first_seq=1, last_seq=100) is None
    assert audit.trim_below(used=5000, limit=0, first_seq=1, last_seq=100) is None
    assert audit.trim_below(used=950, limit=1000, first_seq=10, last_seq=9) is None  # no audit record


def test_past_ninety_percent_the_oldest_share_above_eighty_goes():
    cut = audit.trim_below(used=1000, limit=1000, first_seq=101, last_seq=200)
    assert cut == 101 + 20  # 20 % of the bytes: the oldest 20 % of the records
    assert audit.trim_below(used=901, limit=1000, first_seq=5, last_seq=5) == 6  # at least one


# ---- settings ------------------------------------------------------------------------


def test_retention_and_rate_settings_have_defaults_and_refuse_nonsense():
    retention = bus.RetentionSettings.from_env({})
    assert retention.audit_max_age == 30 * 86400 and retention.events_max_bytes == 8 * 1024**3
    assert bus.BusSettings.from_env({"SBX_AUDIT_MAX_AGE": "7d"}).retention.audit_max_age == 7 * 86400
    rate = audit_settings.AuditRateSettings.from_env({"SBX_AUDIT_RATE": "1m", "SBX_AUDIT_RATE_WINDOW": "1h"})
    assert (rate.bytes_per_window, rate.window) == (1024**2, 3600)
    assert audit_settings.AuditRateSettings.from_env({"SBX_AUDIT_RATE": "0"}).bytes_per_window == 0
    for env in (
        {"SBX_AUDIT_RATE": "1k"},
        {"SBX_AUDIT_RATE_WINDOW": "2d"},
        {"SBX_EVENTS_MAX_BYTES": "1m"},
        {"SBX_AUDIT_MAX_AGE": "soon"},
    ):
        with pytest.raises(errors.ConfigError):
            bus.BusSettings.from_env(env)
            audit_settings.AuditRateSettings.from_env(env)
