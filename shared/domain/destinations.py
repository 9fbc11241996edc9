"""Where host-side code may connect on a tenant's behalf, judged on resolved addresses (pure).

The image puller fetches what a tenant names (a registry, the redirects it sends, the
token realm it names); the host runs it as root, next to the control plane. So the
addresses a name resolves to are judged by the credential proxy's rule: no loopback,
private, link-local, cloud metadata or other special-purpose address, whatever notation
it was written in (decimal ``2130706433``, octal ``0177.0.0.1`` and hex arrive here
already resolved), and IPv6 forms that embed an IPv4 address (mapped ``::ffff:a.b.c.d``,
6to4, NAT64, Teredo) judged by the embedded address too.

This is the services' copy of ``proxy/sbx_proxy/destinations.py``: the proxy is a
distribution of its own, with its own environment, so neither imports the other;
``tests/unit/test_destinations.py`` holds the two to the same ranges. What an operator
allows besides (a registry on a private address) is not decided here: see
``shared/runtime/local/registries.py``.
"""

from __future__ import annotations

import ipaddress

Address = ipaddress.IPv4Address | ipaddress.IPv6Address

_NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))
_EMBEDS_V4 = (
    ipaddress.ip_network("::/96"),
    ipaddress.ip_network("::ffff:0:0:0/96"),
)  # compatible, translated
_SITE_LOCAL = ipaddress.ip_network("fec0::/10")
_NOT_GLOBAL = tuple(
    ipaddress.ip_network(n)
    for n in (
        "0.0.0.0/8", "100.64.0.0/10", "192.0.0.0/24", "192.0.2.0/24", "192.88.99.0/24",
        "198.18.0.0/15", "198.51.100.0/24", "203.0.113.0/24", "240.0.0.0/4",
        "64:ff9b:1::/48", "100::/64", "2001::/23", "2001:db8::/32", "3fff::/20", "5f00::/16",
    )
)  # fmt: skip
"""IANA's special-purpose ranges that are not globally reachable, checked besides
``is_global`` (which older Pythons get wrong for some, e.g. 192.0.0.8 on 3.11)."""
_GLOBAL_EXCEPTIONS = tuple(
    ipaddress.ip_network(n)
    for n in (
        "192.0.0.9/32", "192.0.0.10/32", "2001:1::1/128", "2001:1::2/128", "2001:1::3/128",
        "2001:3::/32", "2001:4:112::/48", "2001:20::/28", "2001:30::/28",
    )
)  # fmt: skip
"""Inside those ranges, the assignments IANA lists as globally reachable."""
METADATA = (
    ipaddress.ip_network("169.254.0.0/16"),  # AWS, GCP, Azure IMDS, ECS task metadata, time sync
    ipaddress.ip_network("fd00:ec2::/32"),  # AWS IMDS and DNS over IPv6
    ipaddress.ip_network("fd20:ce::254/128"),  # GCP metadata over IPv6
    ipaddress.ip_network("168.63.129.16/32"),  # Azure WireServer
    ipaddress.ip_network("100.100.100.200/32"),  # Alibaba Cloud
)


def _embedded(ip: Address) -> list[Address]:
    found: list[Address] = [ip]
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            found.append(ip.ipv4_mapped)
        if ip.sixtofour is not None:
            found.append(ip.sixtofour)
        if ip.teredo is not None:
            found.extend(ip.teredo)
        if any(ip in net for net in (*_NAT64, *_EMBEDS_V4)):
            found.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    return found


def _is_global(ip: Address) -> bool:
    if any(ip.version == n.version and ip in n for n in _GLOBAL_EXCEPTIONS):
        return True
    return ip.is_global and not any(ip.version == n.version and ip in n for n in _NOT_GLOBAL)


def refusal(address: str) -> str | None:
    """Why connecting to the resolved ``address`` is refused, or None if it is a public
    unicast address (an IPv6 zone ``%eth0`` is ignored)."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return f"{address!r} is not an IP address"
    for candidate in _embedded(ip):
        if any(candidate.version == net.version and candidate in net for net in METADATA):
            return f"{candidate} is a cloud metadata address"
        if candidate.version == 6 and candidate in _SITE_LOCAL:
            return f"{candidate} is a site-local address"
        if candidate.is_unspecified or candidate.is_multicast:
            return f"{candidate} is not a unicast address"
        if not _is_global(candidate):
            kind = (
                "loopback"
                if candidate.is_loopback
                else "link-local"
                if candidate.is_link_local
                else "private or reserved"
            )
            return f"{candidate} is a {kind} address"
    return None
