"""Identifier rules (sbx_api.ids, under the server's name shared.contract.ids) and
environment settings parsing (shared.infrastructure.settings)."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sbx_api import errors
from shared.contract import ids
from shared.infrastructure.settings import bus as bus_settings
from shared.infrastructure.settings import gateway, service, values
from shared.infrastructure.settings import lifecycle as lifecycle_settings

KEY = "k3y-0123456789abcdef"  # 20 characters


@pytest.mark.parametrize("value", ["a", "task-42", "A_b-9", "9", "x" * 128])
def test_session_id_accepted(value: str) -> None:
    assert ids.validate_session_id(value) == value


@pytest.mark.parametrize(
    "value",
    [
        "",
        "x" * 129,
        ".",
        "a.b",
        "a*b",
        "a>b",
        "a b",
        "a/b",
        "../x",
        "a\\b",
        "a\nb",
        "a\n",
        "a\x00b",
        "-lead",
        "_lead",
        "é",
        "aé",
        "ａ",
        None,
        42,
        b"abc",
        ["a"],
    ],
)
def test_session_id_rejected(value: object) -> None:
    with pytest.raises(errors.InvalidInput):
        ids.validate_session_id(value)


def test_session_id_error_names_the_field() -> None:
    with pytest.raises(errors.InvalidInput, match="^sandbox name"):
        ids.validate_session_id("a.b", what="sandbox name")


@pytest.mark.parametrize("value", ["a", "a.b", "*", ">", "a b", "../x", "ns.evt.session.>", "é", ""])
def test_token_is_fixed_length_hex(value: str) -> None:
    assert re.fullmatch(r"[0-9a-f]{32}", ids.token(value))
    assert ids.token(value) == ids.token(value)


@given(st.text(), st.text())
def test_token_is_hex_and_injective_in_practice(a: str, b: str) -> None:
    ta, tb = ids.token(a), ids.token(b)
    assert re.fullmatch(r"[0-9a-f]{32}", ta)
    assert (ta == tb) == (a == b)


def test_token_differs_for_near_identical_inputs() -> None:
    tokens = {ids.token(v) for v in ["a", "A", "a ", "a.", "a*", "task-42", "task-43"]}
    assert len(tokens) == 7


def test_new_id_is_random_hex() -> None:
    a, b = ids.new_id(), ids.new_id()
    assert re.fullmatch(r"[0-9a-f]{32}", a) and a != b


@pytest.mark.parametrize(
    "value",
    [None, "python:3.12", "ghcr.io/org/img@sha256:" + "ab12" * 16, "registry:5000/a/b:v1.2-rc_1", "x" * 255],
)
def test_image_accepted(value: str | None) -> None:
    assert ids.validate_image(value) == value


@pytest.mark.parametrize(
    "value",
    ["a b", "$(x)", "x" * 256, "", ":latest", "img;rm", "img\n", 3, "a:b+c", "Upper/img", "a@sha256:12"],
)
def test_image_rejected(value: object) -> None:
    with pytest.raises(errors.InvalidInput):
        ids.validate_image(value)


@pytest.mark.parametrize("value", [None, ""])
def test_attribution_empty_is_none(value: str | None) -> None:
    assert ids.validate_attribution(value, what="org id") is None


@pytest.mark.parametrize("value", ["a\tb", "a\x1bb", "x" * 257, 5])
def test_attribution_rejected(value: object) -> None:
    with pytest.raises(errors.InvalidInput):
        ids.validate_attribution(value, what="org id")


# ---- durations ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90", 90),
        ("90s", 90),
        ("500ms", 0.5),
        ("10m", 600),
        ("1h", 3600),
        ("1h30m", 5400),
        ("1d", 86400),
        ("0", 0),
        ("1.5", 1.5),
        (" 2M ", 120),
        ("1m30s", 90),
        ("2s500ms", 2.5),
    ],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert values.parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    "text", ["", "  ", "abc", "10x", "-5", "1h-", "m", "h1", "1 h", "nan", "inf", "-1s", "1h 30m"]
)
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(errors.ConfigError):
        values.parse_duration(text, name="SBX_X")


def test_parse_duration_error_names_the_variable() -> None:
    with pytest.raises(errors.ConfigError, match="SBX_DRAIN_TIMEOUT"):
        values.parse_duration("soon", name="SBX_DRAIN_TIMEOUT")


# ---- bus / service settings ---------------------------------------------------------------


def test_bus_defaults_and_overrides() -> None:
    assert bus_settings.BusSettings.from_env({}) == bus_settings.BusSettings()
    bus = bus_settings.BusSettings.from_env(
        {"SBX_NAMESPACE": "t_1", "NATS_URL": "nats://n:4222", "SBX_REQUEST_TIMEOUT": "250ms"}
    )
    assert (bus.namespace, bus.nats_url, bus.request_timeout) == ("t_1", "nats://n:4222", 0.25)


@pytest.mark.parametrize("namespace", ["Bad", "a.b", "", "a" * 33, "1abc", "a-b", "a>", "sbx\n"])
def test_bus_rejects_bad_namespace(namespace: str) -> None:
    with pytest.raises(errors.ConfigError, match="SBX_NAMESPACE"):
        bus_settings.BusSettings.from_env({"SBX_NAMESPACE": namespace})


def test_bus_accepts_32_char_namespace() -> None:
    assert bus_settings.BusSettings.from_env({"SBX_NAMESPACE": "a" * 32}).namespace == "a" * 32


def test_bus_request_timeout_minimum() -> None:
    with pytest.raises(errors.ConfigError, match="SBX_REQUEST_TIMEOUT"):
        bus_settings.BusSettings.from_env({"SBX_REQUEST_TIMEOUT": "10ms"})


def test_service_defaults() -> None:
    s = service.ServiceSettings.from_env("reaper", {})
    assert re.fullmatch(r"reaper-[0-9a-f]{12}", s.instance)
    assert (s.log_level, s.log_format, s.health_interval, s.drain_timeout, s.faults) == (
        "info",
        "json",
        2.0,
        10.0,
        frozenset(),
    )


def test_service_overrides() -> None:
    s = service.ServiceSettings.from_env(
        "scheduler",
        {
            "SBX_INSTANCE_ID": "sched-1",
            "SBX_LOG_LEVEL": "DEBUG",
            "SBX_LOG_FORMAT": "console",
            "SBX_HEALTH_INTERVAL": "0.1",
            "SBX_DRAIN_TIMEOUT": "1m",
            "SBX_STATE_DIR": "/tmp/x",
        },
    )
    assert (s.instance, s.log_level, s.log_format, s.health_interval, s.drain_timeout, str(s.state_dir)) == (
        "sched-1",
        "debug",
        "console",
        0.1,
        60.0,
        "/tmp/x",
    )


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("SBX_LOG_LEVEL", "verbose"),
        ("SBX_LOG_LEVEL", ""),
        ("SBX_LOG_FORMAT", "xml"),
        ("SBX_HEALTH_INTERVAL", "0.01"),
        ("SBX_HEALTH_INTERVAL", "abc"),
        ("SBX_HEALTH_INTERVAL", "-1"),
        ("SBX_DRAIN_TIMEOUT", "forever"),
        ("SBX_INSTANCE_ID", "a.b"),
        ("SBX_INSTANCE_ID", "x" * 65),
        ("SBX_NAMESPACE", "Bad"),
    ],
)
def test_service_rejects_bad_values(name: str, value: str) -> None:
    with pytest.raises(errors.ConfigError, match=name):
        service.ServiceSettings.from_env("scheduler", {name: value})


@pytest.mark.parametrize(
    ("raw", "faults"),
    [
        ("", frozenset()),
        ("scheduler.after_append", {"scheduler.after_append"}),
        ("a,b", {"a", "b"}),
        ("a,,b,", {"a", "b"}),
        (",", frozenset()),
    ],
)
def test_service_faults(raw: str, faults: set[str]) -> None:
    assert service.ServiceSettings.from_env("x", {"SBX_FAULTS": raw}).faults == frozenset(faults)


# ---- gateway ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"SANDBOX_API_KEY": ""},
        {"SANDBOX_API_KEY": "x" * 15},
        {"SANDBOX_API_KEY": "0123456789 abcdef"},
        {"SANDBOX_API_KEY": "0123456789abcdéf"},
        {"SANDBOX_API_KEY": "0123456789abcdef\n"},
    ],
    ids=["unset", "empty", "15-chars", "space", "non-ascii", "newline"],
)
def test_gateway_rejects_bad_key(env: dict[str, str]) -> None:
    with pytest.raises(errors.ConfigError, match="SANDBOX_API_KEY"):
        gateway.GatewaySettings.from_env(env)


def test_gateway_accepts_key_and_hides_it() -> None:
    g = gateway.GatewaySettings.from_env({"SANDBOX_API_KEY": KEY, "SBX_GATEWAY_PORT": "0"})
    assert g.api_key == KEY and g.port == 0 and g.host == "127.0.0.1" and g.base.service == "gateway"
    assert KEY not in repr(g) and KEY not in str(g)
    assert gateway.GatewaySettings.from_env({"SANDBOX_API_KEY": "x" * 16}).api_key == "x" * 16


@pytest.mark.parametrize("port", ["65536", "-1", "http", "80a"])
def test_gateway_rejects_bad_port(port: str) -> None:
    with pytest.raises(errors.ConfigError, match="SBX_GATEWAY_PORT"):
        gateway.GatewaySettings.from_env({"SANDBOX_API_KEY": KEY, "SBX_GATEWAY_PORT": port})


# ---- lifecycle ----------------------------------------------------------------------------


def test_lifecycle_defaults() -> None:
    lifecycle = lifecycle_settings.LifecycleSettings.from_env({})
    assert lifecycle == lifecycle_settings.LifecycleSettings()
    assert (
        lifecycle.pool_min_idle,
        lifecycle.pool_image,
        lifecycle.max_running,
        lifecycle.max_stopped,
        lifecycle.max_lifetime,
        lifecycle.idle_timeout,
        lifecycle.stopped_retention,
        lifecycle.reaper_interval,
    ) == (2, "default", 100, 100, 3600.0, 600.0, 86400.0, 30.0)


def test_lifecycle_ignores_unrelated_variables() -> None:
    assert lifecycle_settings.LifecycleSettings.from_env({"SBX_NAMESPACE": "x", "PATH": "/bin"}) == (
        lifecycle_settings.LifecycleSettings()
    )


def test_lifecycle_overrides() -> None:
    lifecycle = lifecycle_settings.LifecycleSettings.from_env(
        {
            "SBX_POOL_MIN_IDLE": "0",
            "SBX_POOL_IMAGE": "ghcr.io/acme/agent:2.1",
            "SBX_MAX_RUNNING": "7",
            "SBX_MAX_STOPPED": "0",
            "SBX_MAX_LIFETIME": "10m",
            "SBX_IDLE_TIMEOUT": "90",
            "SBX_STOPPED_RETENTION": "1d",
            "SBX_REAPER_INTERVAL": "500ms",
        }
    )
    assert lifecycle == lifecycle_settings.LifecycleSettings(
        pool_min_idle=0,
        pool_image="ghcr.io/acme/agent:2.1",
        max_running=7,
        max_stopped=0,
        max_lifetime=600.0,
        idle_timeout=90.0,
        stopped_retention=86400.0,
        reaper_interval=0.5,
    )


@pytest.mark.parametrize(
    ("name", "raw", "attr", "value"),
    [
        ("SBX_MAX_LIFETIME", "1h30m", "max_lifetime", 5400.0),
        ("SBX_MAX_LIFETIME", "1", "max_lifetime", 1.0),
        ("SBX_IDLE_TIMEOUT", "10m", "idle_timeout", 600.0),
        ("SBX_IDLE_TIMEOUT", "1s", "idle_timeout", 1.0),
        ("SBX_PAUSE_TIMEOUT", "2m", "pause_timeout", 120.0),
        ("SBX_PAUSE_TIMEOUT", "0", "pause_timeout", 0.0),
        ("SBX_HIBERNATE_TIMEOUT", "30m", "hibernate_timeout", 1800.0),
        ("SBX_PAUSE_RUNNING_JOBS", "true", "pause_running_jobs", True),
        ("SBX_PAUSE_RUNNING_JOBS", " FALSE ", "pause_running_jobs", False),
        ("SBX_PAUSE_RUNNING_JOBS", "1", "pause_running_jobs", True),
        ("SBX_STOPPED_RETENTION", "2h", "stopped_retention", 7200.0),
        ("SBX_REAPER_INTERVAL", "100ms", "reaper_interval", 0.1),
        ("SBX_REAPER_INTERVAL", "0.1", "reaper_interval", 0.1),
        ("SBX_REAPER_INTERVAL", "5m", "reaper_interval", 300.0),
        ("SBX_POOL_MIN_IDLE", "100", "pool_min_idle", 100),
        ("SBX_POOL_MIN_IDLE", " 3 ", "pool_min_idle", 3),
        ("SBX_MAX_RUNNING", "1", "max_running", 1),
        ("SBX_MAX_RUNNING", "007", "max_running", 7),
        ("SBX_MAX_STOPPED", "0", "max_stopped", 0),
        ("SBX_MAX_STOPPED", "100000", "max_stopped", 100000),
    ],
)
def test_lifecycle_parses(name: str, raw: str, attr: str, value: object) -> None:
    env = {name: raw}
    if name == "SBX_POOL_MIN_IDLE":
        env["SBX_MAX_RUNNING"] = "100"
    if name == "SBX_MAX_RUNNING":
        env["SBX_POOL_MIN_IDLE"] = "0"
    assert getattr(lifecycle_settings.LifecycleSettings.from_env(env), attr) == value


@pytest.mark.parametrize(
    ("name", "raw"),
    [
        ("SBX_POOL_MIN_IDLE", "-1"),
        ("SBX_POOL_MIN_IDLE", "two"),
        ("SBX_POOL_MIN_IDLE", "1.5"),
        ("SBX_POOL_MIN_IDLE", ""),
        ("SBX_MAX_RUNNING", "0"),
        ("SBX_MAX_RUNNING", "-5"),
        ("SBX_MAX_RUNNING", "+5"),
        ("SBX_MAX_RUNNING", "1e3"),
        ("SBX_MAX_RUNNING", "many"),
        ("SBX_MAX_STOPPED", "-1"),
        ("SBX_MAX_STOPPED", "0x10"),
        ("SBX_MAX_STOPPED", " "),
        ("SBX_MAX_LIFETIME", "0.5"),
        ("SBX_MAX_LIFETIME", "0"),
        ("SBX_MAX_LIFETIME", "forever"),
        ("SBX_IDLE_TIMEOUT", "-10m"),
        ("SBX_IDLE_TIMEOUT", "999ms"),
        ("SBX_PAUSE_TIMEOUT", "-1s"),
        ("SBX_PAUSE_TIMEOUT", "later"),
        ("SBX_HIBERNATE_TIMEOUT", "-5m"),
        ("SBX_PAUSE_RUNNING_JOBS", "maybe"),
        ("SBX_STOPPED_RETENTION", "1 day"),
        ("SBX_REAPER_INTERVAL", "99ms"),
        ("SBX_REAPER_INTERVAL", "0.05"),
        ("SBX_REAPER_INTERVAL", "0"),
        ("SBX_REAPER_INTERVAL", "soon"),
    ],
)
def test_lifecycle_rejects_bad_values(name: str, raw: str) -> None:
    env = {name: raw}
    if name == "SBX_MAX_RUNNING":
        env["SBX_POOL_MIN_IDLE"] = "0"  # the error must come from the value itself
    with pytest.raises(errors.ConfigError, match=name):
        lifecycle_settings.LifecycleSettings.from_env(env)


@pytest.mark.parametrize(
    ("min_idle", "max_running"), [("3", "2"), ("2", "1"), ("101", None)], ids=["3>2", "2>1", "101>default"]
)
def test_lifecycle_pool_cannot_exceed_max_running(min_idle: str, max_running: str | None) -> None:
    env = {"SBX_POOL_MIN_IDLE": min_idle}
    if max_running is not None:
        env["SBX_MAX_RUNNING"] = max_running
    with pytest.raises(errors.ConfigError, match="SBX_POOL_MIN_IDLE=.* cannot exceed SBX_MAX_RUNNING"):
        lifecycle_settings.LifecycleSettings.from_env(env)


@pytest.mark.parametrize(("min_idle", "max_running"), [("3", "3"), ("0", "1"), ("1", "1")])
def test_lifecycle_pool_may_equal_max_running(min_idle: str, max_running: str) -> None:
    lifecycle = lifecycle_settings.LifecycleSettings.from_env(
        {"SBX_POOL_MIN_IDLE": min_idle, "SBX_MAX_RUNNING": max_running}
    )
    assert (lifecycle.pool_min_idle, lifecycle.max_running) == (int(min_idle), int(max_running))


@pytest.mark.parametrize("image", ["python:3.12", "ghcr.io/org/img@sha256:" + "ab12" * 16, "default"])
def test_lifecycle_accepts_pool_image(image: str) -> None:
    assert lifecycle_settings.LifecycleSettings.from_env({"SBX_POOL_IMAGE": image}).pool_image == image


@pytest.mark.parametrize("image", ["a b", "$(reboot)", "", "img;rm"])
def test_lifecycle_rejects_bad_pool_image(image: str) -> None:
    with pytest.raises(errors.ConfigError, match="SBX_POOL_IMAGE"):
        lifecycle_settings.LifecycleSettings.from_env({"SBX_POOL_IMAGE": image})


def test_lifecycle_rejects_superscript_digits() -> None:
    with pytest.raises(errors.ConfigError, match="SBX_MAX_STOPPED"):
        lifecycle_settings.LifecycleSettings.from_env({"SBX_MAX_STOPPED": "²"})


@pytest.mark.parametrize("image", ["a b", "$(reboot)", "", "img;rm"])
def test_lifecycle_bad_pool_image_stops_start_up(image: str) -> None:
    with pytest.raises((errors.ConfigError, errors.InvalidInput)):  # ConfigError once the bug above is fixed
        lifecycle_settings.LifecycleSettings.from_env({"SBX_POOL_IMAGE": image})


def test_pools_may_belong_to_an_organisation() -> None:
    pools = '[{"name": "acme", "org": "acme", "min_idle": 3}, {"name": "ro", "writable_root": false}]'
    lifecycle = lifecycle_settings.LifecycleSettings.from_env({"SBX_POOLS": pools})
    assert lifecycle.extra_pools == (
        ("acme", "default", True, True, 3, "acme"),
        ("ro", "default", True, False, 1, None),
    )
    for bad in (
        '[{"name": "x", "org": ""}]',
        '[{"name": "x", "org": "a\\u0007"}]',
        '[{"name": "x", "org": 7}]',
    ):
        with pytest.raises(errors.ConfigError, match="SBX_POOLS"):
            lifecycle_settings.LifecycleSettings.from_env({"SBX_POOLS": bad})


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, False),
        ({"SBX_K8S_CACHE_STORAGE_CLASS": "nfs"}, False),  # the local runtime attaches caches later
        ({"SBX_RUNTIME": "kubernetes"}, False),  # no caches on this cluster
        ({"SBX_RUNTIME": "kubernetes", "SBX_K8S_CACHE_STORAGE_CLASS": "nfs"}, True),
        ({"SBX_RUNTIME": " Kubernetes ", "SBX_K8S_CACHE_STORAGE_CLASS": "nfs"}, True),
    ],
)
def test_caches_are_chosen_at_creation_only_on_kubernetes_with_a_cache_class(env, expected) -> None:
    assert lifecycle_settings.LifecycleSettings.from_env(env).caches_at_create is expected


@pytest.mark.parametrize(("raw", "expected"), [(None, True), ("on", True), (" OFF ", False), ("off", False)])
def test_claim_on_connect_is_on_unless_turned_off(raw, expected) -> None:
    env = {"SANDBOX_API_KEY": KEY} | ({"SBX_CLAIM_ON_CONNECT": raw} if raw is not None else {})
    assert gateway.GatewaySettings.from_env(env).claim_on_connect is expected
    with pytest.raises(errors.ConfigError, match="SBX_CLAIM_ON_CONNECT"):
        gateway.GatewaySettings.from_env({"SANDBOX_API_KEY": KEY, "SBX_CLAIM_ON_CONNECT": "maybe"})


def test_nats_replicas_are_one_to_five() -> None:
    assert bus_settings.BusSettings.from_env({}).replicas == 1
    assert bus_settings.BusSettings.from_env({"SBX_NATS_REPLICAS": "3"}).replicas == 3
    for bad in ("0", "6", "three", "-1"):
        with pytest.raises(errors.ConfigError, match="SBX_NATS_REPLICAS"):
            bus_settings.BusSettings.from_env({"SBX_NATS_REPLICAS": bad})


def test_cors_origins_are_exact_origins() -> None:
    env = {"SANDBOX_API_KEY": KEY, "SBX_CORS_ORIGINS": " https://app.example , http://localhost:5173/"}
    assert gateway.GatewaySettings.from_env(env).cors_origins == (
        "https://app.example",
        "http://localhost:5173",
    )
    assert gateway.GatewaySettings.from_env({"SANDBOX_API_KEY": KEY}).cors_origins == ()
    for bad in ("*", "https://app.example/path", "app.example", "https://*.example"):
        with pytest.raises(errors.ConfigError, match="SBX_CORS_ORIGINS"):
            gateway.GatewaySettings.from_env({"SANDBOX_API_KEY": KEY, "SBX_CORS_ORIGINS": bad})


@pytest.mark.parametrize("value", ["acme", "Ann Example", "équipe 日本", "a" * 256])
def test_attribution_accepted(value: str) -> None:
    assert ids.validate_attribution(value, what="org id") == value


@pytest.mark.parametrize("value", ["a\nb", "a\u202eb", "a\u200bb", "\x85", "x\n"])
def test_attribution_without_controls_or_invisible_formatting(value: str) -> None:
    with pytest.raises(errors.InvalidInput, match="control or invisible"):
        ids.validate_attribution(value, what="org id")


def test_attribution_in_a_header_is_printable_ascii() -> None:
    assert ids.validate_attribution("acme-1", what="X-Org-Id header", header=True) == "acme-1"
    with pytest.raises(errors.InvalidInput, match="printable ASCII"):
        ids.validate_attribution("équipe", what="X-Org-Id header", header=True)


@pytest.mark.parametrize("name", ["a.b", "a:b", "-lead", "x" * 129])
def test_the_host_client_refuses_a_session_name_the_server_refuses(name: str, tmp_path) -> None:
    """The client applies the contract's rule (sbx_api.ids), not a copy of its own: a name
    the gateway would refuse is refused before anything is sent."""
    from sbx_client.sandbox import Sandbox, SyncError

    code = tmp_path / "project"
    (code / ".git").mkdir(parents=True)
    with pytest.raises(SyncError, match="session name"):
        Sandbox(
            code,
            name,
            env={
                "HOME": str(tmp_path / "home"),
                "SBX_URL": "http://127.0.0.1:9",
                "SANDBOX_API_KEY": "k" * 32,
            },
        )
    with pytest.raises(errors.InvalidInput):
        ids.validate_session_id(name)
