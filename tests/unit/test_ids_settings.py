"""Identifier rules (shared.ids) and environment settings parsing (shared.settings)."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared import errors, ids, settings

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
    [None, "python:3.12", "ghcr.io/org/img@sha256:" + "ab12" * 16, "registry:5000/a/b:v1.2-rc+1", "x" * 256],
)
def test_image_accepted(value: str | None) -> None:
    assert ids.validate_image(value) == value


@pytest.mark.parametrize("value", ["a b", "$(x)", "x" * 257, "", ":latest", "img;rm", "img\n", 3])
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
    assert settings.parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    "text", ["", "  ", "abc", "10x", "-5", "1h-", "m", "h1", "1 h", "nan", "inf", "-1s", "1h 30m"]
)
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(errors.ConfigError):
        settings.parse_duration(text, name="SBX_X")


def test_parse_duration_error_names_the_variable() -> None:
    with pytest.raises(errors.ConfigError, match="SBX_DRAIN_TIMEOUT"):
        settings.parse_duration("soon", name="SBX_DRAIN_TIMEOUT")


# ---- bus / service settings ---------------------------------------------------------------


def test_bus_defaults_and_overrides() -> None:
    assert settings.BusSettings.from_env({}) == settings.BusSettings()
    bus = settings.BusSettings.from_env(
        {"SBX_NAMESPACE": "t_1", "NATS_URL": "nats://n:4222", "SBX_REQUEST_TIMEOUT": "250ms"}
    )
    assert (bus.namespace, bus.nats_url, bus.request_timeout) == ("t_1", "nats://n:4222", 0.25)


@pytest.mark.parametrize("namespace", ["Bad", "a.b", "", "a" * 33, "1abc", "a-b", "a>", "sbx\n"])
def test_bus_rejects_bad_namespace(namespace: str) -> None:
    with pytest.raises(errors.ConfigError, match="SBX_NAMESPACE"):
        settings.BusSettings.from_env({"SBX_NAMESPACE": namespace})


def test_bus_accepts_32_char_namespace() -> None:
    assert settings.BusSettings.from_env({"SBX_NAMESPACE": "a" * 32}).namespace == "a" * 32


def test_bus_request_timeout_minimum() -> None:
    with pytest.raises(errors.ConfigError, match="SBX_REQUEST_TIMEOUT"):
        settings.BusSettings.from_env({"SBX_REQUEST_TIMEOUT": "10ms"})


def test_service_defaults() -> None:
    s = settings.ServiceSettings.from_env("reaper", {})
    assert re.fullmatch(r"reaper-[0-9a-f]{12}", s.instance)
    assert (s.log_level, s.log_format, s.health_interval, s.drain_timeout, s.faults) == (
        "info",
        "json",
        2.0,
        10.0,
        frozenset(),
    )


def test_service_overrides() -> None:
    s = settings.ServiceSettings.from_env(
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
        settings.ServiceSettings.from_env("scheduler", {name: value})


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
    assert settings.ServiceSettings.from_env("x", {"SBX_FAULTS": raw}).faults == frozenset(faults)


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
        settings.GatewaySettings.from_env(env)


def test_gateway_accepts_key_and_hides_it() -> None:
    g = settings.GatewaySettings.from_env({"SANDBOX_API_KEY": KEY, "SBX_GATEWAY_PORT": "0"})
    assert g.api_key == KEY and g.port == 0 and g.host == "127.0.0.1" and g.base.service == "gateway"
    assert KEY not in repr(g) and KEY not in str(g)
    assert settings.GatewaySettings.from_env({"SANDBOX_API_KEY": "x" * 16}).api_key == "x" * 16


@pytest.mark.parametrize("port", ["65536", "-1", "http", "80a"])
def test_gateway_rejects_bad_port(port: str) -> None:
    with pytest.raises(errors.ConfigError, match="SBX_GATEWAY_PORT"):
        settings.GatewaySettings.from_env({"SANDBOX_API_KEY": KEY, "SBX_GATEWAY_PORT": port})
