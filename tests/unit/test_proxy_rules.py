"""The credential proxy's pure decisions (proxy/sbx_proxy): which rule applies to a
route, which destinations are refused, config validation, secret masking."""

from __future__ import annotations

import ipaddress
import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sbx_proxy import config, credentials, destinations, hosts, redact

CONFIGURED = frozenset({("github.com", 443)})


def route(connect=("github.com", 443), sni="github.com", authority="github.com", scheme="https", tls=True):
    return hosts.Route(connect=connect, sni=sni, authority=authority, scheme=scheme, client_tls=tls)


@pytest.mark.parametrize(
    "r, action",
    [
        (route(), "inject"),
        (route(authority="github.com:443"), "inject"),
        (route(connect=("GitHub.COM", 443), sni="github.com", authority="GITHUB.com"), "inject"),
        (route(authority="evil.example"), "refuse"),
        (route(authority="github.com:8443"), "refuse"),
        (route(authority=None), "refuse"),
        (route(authority="github.com@evil.example"), "refuse"),
        (route(sni="evil.example"), "refuse"),
        (route(sni=None), "refuse"),
        (route(connect=("evil.example", 443)), "pass"),
        (route(connect=("github.com", 8443), authority="github.com:8443"), "pass"),
        (route(connect=("github.com.", 443), sni="github.com.", authority="github.com."), "pass"),
        (route(connect=("github.com.evil.net", 443)), "pass"),
        (route(connect=("xn--gthub-n4a.com", 443)), "pass"),
        (route(connect=None, scheme="http"), "pass"),
        (route(scheme="http"), "pass"),
        (route(tls=False), "pass"),
        (
            hosts.Route(("github.com", 443), "github.com", "github.com", "https", True, "evil.example"),
            "refuse",
        ),
        (hosts.Route(("github.com", 443), "github.com", "github.com", "https", True, "github.com"), "refuse"),
    ],
)
def test_decide(r, action):
    assert hosts.decide(r, CONFIGURED).action == action


@given(st.text(max_size=40))
def test_only_the_exact_configured_name_ever_injects(name):
    decision = hosts.decide(route(connect=(name, 443), sni=name, authority=name), CONFIGURED)
    assert decision.action != "inject" or hosts.normalize(name) == "github.com"


@pytest.mark.parametrize(
    "value, expected",
    [
        ("github.com", ("github.com", 443)),
        ("github.com:8443", ("github.com", 8443)),
        ("[::1]:8443", ("[::1]", 8443)),
        ("github.com:", None),
        ("github.com:0", None),
        ("github.com:99999", None),
        ("a:b:c", None),
        ("", None),
    ],
)
def test_split_authority(value, expected):
    assert hosts.split_authority(value, 443) == expected


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1", "10.0.0.1", "172.16.5.4", "192.168.1.1", "100.64.0.1", "169.254.169.254",
        "169.254.1.1", "0.0.0.0", "224.0.0.1", "255.255.255.255", "::1", "::", "fe80::1",
        "fd00:ec2::254", "fc00::1", "::ffff:127.0.0.1", "::ffff:10.0.0.1", "2002:7f00:1::1",
        "64:ff9b::a00:1", "ff02::1", "::7f00:1", "::ffff:0:7f00:1", "64:ff9b:1::a00:1", "fec0::1",
        "168.63.129.16", "100.100.100.200", "169.254.170.2", "fd00:ec2::253",
        # IANA special-purpose, not globally reachable (Python 3.11 calls some of them global)
        "192.0.0.8", "192.0.0.1", "192.0.0.170", "192.0.2.1", "198.18.0.1", "240.0.0.1",
        "64:ff9b:1::1", "2001:db8::1", "2001:2::1", "100::1", "3fff::1", "5f00::1",
    ],
)  # fmt: skip
def test_private_loopback_link_local_and_metadata_are_refused(address):
    assert destinations.refusal(address, allow_private=False) is not None


@pytest.mark.parametrize(
    "address", ["140.82.112.3", "8.8.8.8", "2606:4700::1111", "192.0.0.9", "192.0.0.10", "2001:4:112::1"]
)
def test_public_addresses_pass(address):
    assert destinations.refusal(address, allow_private=False) is None


def test_allow_lists_win_and_metadata_needs_an_explicit_allow():
    net = ipaddress.ip_network("10.20.0.0/16")
    assert destinations.refusal("10.20.1.1", allow_private=False, allow=[net]) is None
    assert destinations.refusal("10.1.1.1", allow_private=True) is None
    assert "metadata" in str(destinations.refusal("169.254.169.254", allow_private=True))
    for other_metadata in ("169.254.170.2", "168.63.129.16", "fd00:ec2::253", "fd20:ce::254"):
        refusal = destinations.refusal(other_metadata, allow_private=True)
        assert refusal is not None and refusal.reason == "metadata_address"
        assert "metadata" in str(refusal)
    meta = ipaddress.ip_network("169.254.169.254/32")
    assert destinations.refusal("169.254.169.254", allow_private=True, allow=[meta]) is None


def test_config_loads_and_names_the_field_at_fault(tmp_path):
    token = tmp_path / "token"
    token.write_text("abc123secret\n")
    loaded = config.parse(
        {
            "destinations": {"allow": ["10.0.0.0/8"]},
            "rules": [
                {"name": "npm", "kind": "bearer", "hosts": ["registry.npmjs.org"], "token_file": str(token)},
                {"kind": "gitlab", "hosts": ["gitlab.example:8443"], "token_env": "GL"},
            ],
        },
        env={"GL": "gl-secret"},
    )
    assert loaded.rule_for("REGISTRY.npmjs.org", 443).token == "abc123secret"
    assert loaded.rule_for("gitlab.example", 443) is None
    assert loaded.rule_for("gitlab.example", 8443).token == "gl-secret"
    assert "abc123secret" not in repr(loaded)
    assert loaded.env_names == ("GL",)  # what the process starting a proxy hands it: only this
    bad = [
        ({"rules": [{"kind": "nope", "hosts": ["a.b"]}]}, "rules[0].kind"),
        ({"rules": [{"kind": "bearer", "hosts": ["A.b"], "token": "x"}]}, "rules[0].hosts"),
        ({"rules": [{"kind": "bearer", "hosts": ["a.b."], "token": "x"}]}, "rules[0].hosts"),
        ({"rules": [{"kind": "bearer", "hosts": ["a.b"]}]}, "token_file or token_env"),
        ({"rules": [{"kind": "bearer", "hosts": ["a.b"], "token": "x", "token_env": "Y"}]}, "only one"),
        ({"rules": [{"kind": "bearer", "hosts": ["a.b"], "token_env": "MISSING"}]}, "MISSING is not set"),
        ({"rules": [{"kind": "bearer", "hosts": ["a.b"], "token": "x", "extra": 1}]}, "unknown field"),
        ({"rules": [{"kind": "bearer", "hosts": ["a.b"], "token": "x"}] * 2}, "already has a rule"),
        ({"rules": [{"kind": "github_app", "hosts": ["a.b"], "app_id": 1}]}, "installation_id"),
        ({"destinations": {"allow": ["nonsense"]}}, "destinations.allow"),
        ({"other": 1}, "unknown top-level"),
    ]
    for data, message in bad:
        with pytest.raises(config.ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
            config.parse(data, env={})


def test_a_missing_or_broken_config_file_is_a_clear_error(tmp_path):
    assert config.load(None).rules == ()
    with pytest.raises(config.ConfigError, match="cannot read"):
        config.load(tmp_path / "absent.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("[[rules]\n")
    with pytest.raises(config.ConfigError, match="not valid TOML"):
        config.load(broken)


@pytest.mark.parametrize(
    "path, query, git",
    [
        ("/org/repo.git/info/refs", "service=git-upload-pack", True),
        ("/org/repo/info/refs", "service=git-receive-pack", True),
        ("/org/repo.git/git-upload-pack", "", True),
        ("/org/repo.git/git-receive-pack", "", True),
        ("/org/repo.git/info/lfs/objects/batch", "", True),
        ("/org/repo/info/refs", "", False),
        ("/repos/org/repo/pulls", "", False),
    ],
)
def test_git_smart_http_requests_are_recognized(path, query, git):
    assert credentials.is_git(path, query) is git


@given(st.binary(max_size=300), st.lists(st.integers(min_value=0, max_value=300), max_size=6))
def test_masking_finds_secrets_across_any_chunking(prefix, cuts):
    secret = "s3cr3t-t0ken-value"
    data = prefix + secret.encode() + prefix + secret.encode()
    masker = redact.Redactor([secret])
    bounds = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    out = b"".join(masker(data[a:b]) for a, b in itertools.pairwise(bounds)) + masker(b"")
    assert len(out) == len(data), "same length: message framing stays valid"
    assert secret.encode() not in out
    assert out == data.replace(secret.encode(), b"*" * len(secret))


async def test_what_each_rule_kind_adds(tmp_path):
    """Git smart-HTTP gets basic auth in the form each forge expects; the API gets a bearer."""
    import base64

    def decoded(value: str) -> str:
        return base64.b64decode(value.removeprefix("Basic ")).decode()

    gitlab = credentials.Provider(
        config.Rule(name="gl", kind="gitlab", hosts=(("gl.example", 443),), token="glpat-x1")
    )
    git = await gitlab.injection("gl.example", "GET", "/g/p.git/info/refs", "service=git-upload-pack")
    assert decoded(git.headers["Authorization"]) == "oauth2:glpat-x1" and "glpat-x1" in git.secrets
    api = await gitlab.injection("gl.example", "GET", "/api/v4/projects", "")
    assert api.headers == {"Authorization": "Bearer glpat-x1"}
    basic = credentials.Provider(
        config.Rule(name="b", kind="basic", hosts=(("a.example", 443),), username="ci", password="pw-secret")
    )
    got = await basic.injection("a.example", "PUT", "/x", "")
    assert decoded(got.headers["Authorization"]) == "ci:pw-secret" and "pw-secret" in got.secrets
    hook_file = tmp_path / "hook.py"
    hook_file.write_text("def credentials(host, method, path):\n    return {'X-Key': 'k\\nbad'}\n")
    hook = credentials.Provider(
        config.Rule(name="h", kind="hook", hosts=(("h.example", 443),), hook_file=str(hook_file))
    )
    with pytest.raises(ValueError, match="header name"):
        await hook.injection("h.example", "GET", "/", "")
    broken = tmp_path / "broken.py"
    broken.write_text("x = (\n")
    with pytest.raises(config.ConfigError, match="failed to load"):
        credentials.Provider(
            config.Rule(name="h2", kind="hook", hosts=(("h.example", 443),), hook_file=str(broken))
        )
