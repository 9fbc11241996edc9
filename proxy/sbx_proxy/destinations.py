"""Where the proxy may connect, checked on the addresses a name resolves to (pure).

Checked after resolution, so a name that resolves to a private address (DNS rebinding,
``localtest.me``-style names) is refused exactly like the literal address; numeric
forms the resolver accepts (decimal ``2130706433``, octal ``0177.0.0.1``, hex) arrive
here already resolved. IPv6 forms that embed an IPv4 address (mapped ``::ffff:a.b.c.d``,
6to4, NAT64 ``64:ff9b::/96``, Teredo) are judged by the embedded address too.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from sbx_proxy import egress

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

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


def refusal(address: str, *, allow_private: bool, allow: Iterable[Network] = ()) -> egress.Refusal | None:
    """Why connecting to ``address`` is refused, or None if it is allowed.

    ``allow`` networks are always allowed (an internal git server, a test upstream);
    ``allow_private`` turns the private-range rule off (metadata addresses stay refused
    unless listed in ``allow``).
    """
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return egress.Refusal(egress.Reason.UNRESOLVABLE, f"{address!r} is not an IP address")
    allowed = list(allow)
    for candidate in _embedded(ip):
        if any(candidate.version == net.version and candidate in net for net in allowed):
            continue
        if any(candidate.version == net.version and candidate in net for net in METADATA):
            return egress.Refusal(egress.Reason.METADATA_ADDRESS, f"{candidate} is a cloud metadata address")
        if candidate.version == 6 and candidate in _SITE_LOCAL and not allow_private:
            return _private(f"{candidate} is a site-local address")
        if candidate.is_unspecified or candidate.is_multicast:
            return _private(f"{candidate} is not a unicast address")
        if not allow_private and not _is_global(candidate):
            kind = (
                "loopback"
                if candidate.is_loopback
                else "link-local"
                if candidate.is_link_local
                else "private or reserved"
            )
            return _private(f"{candidate} is a {kind} address")
    return None


def _private(detail: str) -> egress.Refusal:
    return egress.Refusal(egress.Reason.PRIVATE_ADDRESS, detail)
