"""Pool autosizing (shared.domain.poolsizing): a floor plus the recent peak demand, capped."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from shared.domain import poolsizing

SIZING = poolsizing.Sizing(max_idle=100, horizon=10.0, window=600.0)


def test_a_quiet_pool_stays_at_its_floor() -> None:
    assert poolsizing.target(2, poolsizing.peak([], 1000.0, SIZING), SIZING) == 2
    assert poolsizing.Demand(SIZING).target("p", 2, 1000.0) == 2


def test_a_burst_makes_the_pool_keep_as_many_more_until_the_window_passes() -> None:
    demand = poolsizing.Demand(SIZING)
    for i in range(50):
        demand.add("p", 1000.0 + i * 0.01)
    assert demand.peak("p", 1001.0) == 50
    assert demand.target("p", 2, 1001.0) == 52
    assert demand.target("other", 2, 1001.0) == 2  # per pool
    assert demand.target("p", 2, 1000.5 + SIZING.window) == 2  # forgotten: back to the floor


def test_demand_is_the_busiest_horizon_not_the_total() -> None:
    """8 a second for a minute is 80 per horizon of 10 s, not 480."""
    times = [1000.0 + i / 8 for i in range(480)]
    assert poolsizing.peak(times, 1060.0, SIZING) == 80
    spread = [1000.0 + i * 20.0 for i in range(20)]  # one every 20 s
    assert poolsizing.peak(spread, 1400.0, SIZING) == 1


def test_the_cap_bounds_growth_but_never_the_floor() -> None:
    assert poolsizing.target(2, 500, SIZING) == 100
    assert poolsizing.target(150, 500, SIZING) == 150  # an operator's floor above the cap stands
    off = poolsizing.Sizing(enabled=False)
    assert poolsizing.target(2, 500, off) == 2


@given(
    st.lists(st.floats(min_value=0, max_value=2000, allow_nan=False), max_size=200),
    st.integers(min_value=0, max_value=50),
)
def test_target_is_between_floor_and_cap(times: list[float], floor: int) -> None:
    peak = poolsizing.peak(times, 2000.0, SIZING)
    assert 0 <= peak <= len(times)
    assert floor <= poolsizing.target(floor, peak, SIZING) <= max(floor, SIZING.max_idle)


def test_the_demand_kept_is_bounded() -> None:
    demand = poolsizing.Demand(SIZING)
    for i in range(poolsizing.Demand.KEPT + 10):
        demand.add("p", 1000.0 + i * 1e-4)
    assert demand.peak("p", 1002.0) == poolsizing.Demand.KEPT


def test_the_settings_are_read_and_bad_values_refused() -> None:
    from sbx_api import errors
    from shared.infrastructure.settings import lifecycle

    default = lifecycle.LifecycleSettings.from_env({})
    assert default.pool_autosize and default.pool_max_idle == 100
    made = lifecycle.LifecycleSettings.from_env(
        {"SBX_POOL_AUTOSIZE": "false", "SBX_POOL_MAX_IDLE": "7", "SBX_POOL_HORIZON": "30s",
         "SBX_POOL_DEMAND_WINDOW": "1h"}
    )  # fmt: skip
    assert (made.pool_autosize, made.pool_max_idle, made.pool_horizon, made.pool_demand_window) == (
        False, 7, 30.0, 3600.0,
    )  # fmt: skip
    for bad in ({"SBX_POOL_AUTOSIZE": "maybe"}, {"SBX_POOL_MAX_IDLE": "-1"}, {"SBX_POOL_HORIZON": "0"}):
        try:
            lifecycle.LifecycleSettings.from_env(bad)
        except errors.ConfigError as exc:
            assert next(iter(bad)) in exc.message
        else:
            raise AssertionError(f"{bad} was accepted")
