"""Where the image puller may connect (pure): the destination rule the services share with
the credential proxy, the operator's allow-list, and each hop's check with a resolver given
here (no network). Also the pure parts of a pull's disk rules: chain keys and the reserve."""

from __future__ import annotations

import ast
from pathlib import Path

import httpx
import pytest

from shared.domain import destinations
from shared.runtime.local import disk, layers, registry
from shared.runtime.local.registries import Registry, RegistryConfig
from tests import support


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1", "127.1.2.3", "::1", "0.0.0.0", "::", "10.0.0.1", "172.16.5.4", "192.168.1.1",
        "100.64.0.1", "169.254.169.254", "fd00:ec2::254", "168.63.129.16", "100.100.100.200",
        "fe80::1", "fe80::1%eth0", "fec0::1", "fc00::1", "224.0.0.1", "ff02::1", "192.0.2.1",
        "198.51.100.7", "203.0.113.9", "198.18.0.1", "240.0.0.1", "255.255.255.255",
        "::ffff:127.0.0.1", "::ffff:7f00:1", "::127.0.0.1", "64:ff9b::a9fe:a9fe", "2002:7f00:1::1",
        "2001:0:4136:e378:8000:63bf:80ff:fffe", "2001:db8::1", "not-an-address",
    ],
)  # fmt: skip
def test_loopback_private_link_local_metadata_and_special_ranges_are_refused(address: str) -> None:
    assert destinations.refusal(address) is not None


@pytest.mark.parametrize("address", ["93.184.216.34", "140.82.112.3", "2606:4700::6810:84e5", "192.0.0.9"])
def test_public_addresses_are_allowed(address: str) -> None:
    assert destinations.refusal(address) is None


def _networks(path: Path) -> set[str]:
    """Every string literal of a module that is a network or address range."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "/" in node.value:
            if all(c in "0123456789abcdef.:/" for c in node.value):
                found.add(node.value)
    return found


def test_the_services_copy_of_the_rule_has_the_proxys_ranges() -> None:
    """Two copies of one rule (the proxy is a distribution of its own): held equal here."""
    ours = _networks(support.ROOT / "shared" / "domain" / "destinations.py")
    proxys = _networks(support.ROOT / "proxy" / "sbx_proxy" / "destinations.py")
    assert ours == proxys and len(ours) > 20


def test_the_operator_names_hosts_by_name_and_port() -> None:
    config = RegistryConfig(
        {
            "registry.internal:5000": Registry(insecure=True),
            "ghcr.io": Registry("bot", "pw"),
            "[fd00::5]:5000": Registry(insecure=True),
            "docker.io": Registry(mirrors=("mirror.internal",)),
        }
    )
    assert config.names("registry.internal", 5000, "http") and config.insecure("registry.internal", 5000)
    assert not config.names("registry.internal", 5001, "https")
    assert config.names("ghcr.io", 443, "https") and not config.names("ghcr.io", 8080, "https")
    assert not config.insecure("ghcr.io", 80) and not config.insecure("ghcr.io", 443)
    assert config.names("fd00::5", 5000, "https") and config.insecure("fd00::5", 5000)
    assert config.names("mirror.internal", 443, "https") and not config.insecure("mirror.internal", 80)
    assert config.names("registry-1.docker.io", 443, "https")  # Docker Hub's API host
    assert not RegistryConfig().names("localhost", 443, "https")


def _client(config: RegistryConfig, answers: dict[str, list[str]]) -> registry.Client:
    return registry.Client(config, resolver=lambda host, port: answers[host])


def test_each_hop_is_resolved_once_and_every_address_must_pass() -> None:
    client = _client(
        RegistryConfig({"internal.example:5000": Registry(insecure=True)}),
        {
            "public.example": ["93.184.216.34", "93.184.216.35"],
            "mixed.example": ["93.184.216.34", "10.0.0.1"],  # one private answer is enough
            "rebind.example": ["127.0.0.1"],
            "internal.example": ["10.1.2.3"],
        },
    )
    assert client.destination(httpx.URL("https://public.example/v2/")) == "93.184.216.34"
    for url in ("https://mixed.example/v2/", "https://rebind.example/v2/", "https://internal.example/v2/"):
        with pytest.raises(registry.Refused):
            client.destination(httpx.URL(url))
    assert client.destination(httpx.URL("http://internal.example:5000/v2/")) == "10.1.2.3"  # named
    with pytest.raises(registry.Refused, match="plain HTTP"):
        client.destination(httpx.URL("http://public.example/v2/"))
    with pytest.raises(registry.Refused, match="scheme"):
        client.destination(httpx.URL("ftp://public.example/x"))


def test_chain_keys_name_a_layer_by_every_layer_below_it() -> None:
    a, b, c = (f"sha256:{n * 64}" for n in "abc")
    assert layers.chain_keys([a]) == ["a" * 64]  # the bottom layer reads nothing below
    ab, cb = layers.chain_keys([a, b]), layers.chain_keys([c, b])
    assert ab[0] == "a" * 64 and ab[1] != "b" * 64 and ab[1] != cb[1]
    assert layers.chain_keys([a, b, c])[:2] == ab


def test_the_reserve_counts_bytes_and_inodes() -> None:
    room = disk.Free(bytes=100 * 1024**2, inodes=1000)
    limits = {"reserve_bytes": 50 * 1024**2, "reserve_inodes": 100}
    assert disk.shortfall(room, **limits) is None
    assert "MiB free" in str(disk.shortfall(room, **limits, more_bytes=60 * 1024**2))
    assert "inodes free" in str(disk.shortfall(room, **limits, more_inodes=950))
    assert disk.shortfall(disk.Free(10**12, None), **limits, more_inodes=10**9) is None  # no inode limit
