"""Proxy-only egress for local sandboxes.

Each sandbox already has its own network namespace (bwrap ``--unshare-all``). With
egress ``proxy`` it also gets one end of a veth pair (``eth0``, a /30 of 10.213.0.0/16)
and a single route: to the proxy address, ``10.213.255.254``, which the host holds on
``lo`` and where the proxy listens. There is no default route and no DNS server: the
sandbox can reach the proxy and nothing else, and the proxy resolves names itself.

The host side is closed by one nftables table (``inet cloud_agent_sandbox``): packets
from sandbox interfaces (``sbxh*``) may reach the proxy ports on the proxy address and
are dropped otherwise (host services bound to 0.0.0.0, the control plane, other
sandboxes, IPv6 link-local), nothing is forwarded to or from them, and the proxy
address is unreachable from any other interface.

The veth pair lives as long as the sandbox's network namespace: when the sandbox stops
(every process killed) the kernel removes both ends, so nothing is left to clean up. A
slot (interface name + addresses) is picked by trying to create the interface: the
kernel refuses a name in use, so concurrent starts never share one.

Pure planning (``slot``, ``ruleset``) is kept apart from the commands that apply it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import ipaddress
import json
import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

from sbx_api import errors
from shared.runtime.local import netlink

SUBNET = ipaddress.IPv4Network("10.213.0.0/16")
PROXY_ADDRESS = "10.213.255.254"
SANDBOX_PORT = 3128
"""The port every sandbox's ``HTTP(S)_PROXY`` names. Nothing listens there: the host
rewrites each sandbox's connections to the port of the proxy assigned to it (an
nftables map from the sandbox's host-side interface *index* to port: indexes are not
reused while the kernel runs, so a stale entry can never route a newer sandbox, of this
stack or another on the same host). A sandbox never needs to know which proxy of the
fleet it uses, and a reassignment changes nothing inside it. A sandbox with no
assignment is refused at once (TCP reset), and the proxies' own ports accept only
connections rewritten this way: a sandbox cannot pick another proxy by port."""
PROXY_PORTS = (3129, 3191)
"""Ports the proxies of the fleet listen on."""
NAT_TABLE = "cloud_agent_sandbox_nat"
SLOTS = SUBNET.num_addresses // 4 - 1
"""One /30 per sandbox; the last /30 holds the proxy address."""
HOST_PREFIX = "sbxh"
TABLE = "cloud_agent_sandbox"


@dataclass(frozen=True)
class Slot:
    index: int
    host_if: str
    host_ip: str
    sandbox_ip: str
    ifindex: int = 0
    """The host-side interface's index once created (the routing key)."""


def slot(index: int) -> Slot:
    if not 0 <= index < SLOTS:
        raise ValueError(f"slot {index} out of range")
    base = int(SUBNET.network_address) + 4 * index
    return Slot(
        index=index,
        host_if=f"{HOST_PREFIX}{index}",
        host_ip=str(ipaddress.IPv4Address(base + 1)),
        sandbox_ip=str(ipaddress.IPv4Address(base + 2)),
    )


def first_slot(token: str) -> int:
    """Where to start looking for a free slot: spread by the sandbox's token."""
    return int(token[:8], 16) % SLOTS


def proxy_url(port: int = SANDBOX_PORT) -> str:
    return f"http://{PROXY_ADDRESS}:{port}"


def ruleset() -> str:
    """The host's nftables tables, applied in one transaction. The filter table is
    replaced whole; the NAT table keeps its assignment map (its elements are the live
    assignments) and only its chain is rewritten."""
    low, high = PROXY_PORTS
    return f"""
table inet {TABLE}
delete table inet {TABLE}
table inet {TABLE} {{
    chain input {{
        type filter hook input priority filter - 10; policy accept;
        iifname "{HOST_PREFIX}*" ip daddr {PROXY_ADDRESS} tcp dport {low}-{high} ct status dnat accept
        iifname "{HOST_PREFIX}*" ip daddr {PROXY_ADDRESS} tcp dport {SANDBOX_PORT} counter reject with tcp reset
        iifname "{HOST_PREFIX}*" counter drop
        iifname != "lo" ip daddr {SUBNET} counter drop
    }}
    chain forward {{
        type filter hook forward priority filter - 10; policy accept;
        iifname "{HOST_PREFIX}*" counter drop
        oifname "{HOST_PREFIX}*" counter drop
    }}
}}
add table inet {NAT_TABLE}
add map inet {NAT_TABLE} proxy_of_link {{ type iface_index : inet_service; }}
add chain inet {NAT_TABLE} prerouting {{ type nat hook prerouting priority dstnat; policy accept; }}
flush chain inet {NAT_TABLE} prerouting
add rule inet {NAT_TABLE} prerouting iifname "{HOST_PREFIX}*" ip daddr {PROXY_ADDRESS} tcp dport {SANDBOX_PORT} dnat ip to {PROXY_ADDRESS} : meta iif map @proxy_of_link
"""


class Network:
    """Applies the plan with ``nft``, ``ip`` (the host's proxy address) and netlink (root only)."""

    def __init__(self) -> None:
        self.ip = shutil.which("ip") or "/usr/sbin/ip"
        self.nft = shutil.which("nft") or "/usr/sbin/nft"
        self._host_ready = False
        self._lock = asyncio.Lock()

    def unavailable(self) -> str | None:
        """Why proxy egress cannot be set up here (None: it can)."""
        if os.geteuid() != 0:
            return "proxy egress needs root (veth pairs and nftables)"
        for tool, package in ((self.ip, "iproute2"), (self.nft, "nftables")):
            if not Path(tool).exists():
                return f"proxy egress needs {Path(tool).name} (install {package})"
        return None

    async def _run(self, *argv: str, stdin: str | None = None) -> tuple[int, str]:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        out, _ = await proc.communicate(stdin.encode() if stdin is not None else None)
        assert proc.returncode is not None
        return proc.returncode, out.decode(errors="replace").strip()

    async def ensure_host(self) -> None:
        """The nftables table and the proxy address on ``lo`` (idempotent)."""
        async with self._lock:
            if self._host_ready:  # still there? (an nftables restart or `nft flush ruleset` removes it)
                if all(netlink.nft_table_exists(t) for t in (TABLE, NAT_TABLE)):
                    return
                self._host_ready = False
            why = self.unavailable()
            if why:
                raise errors.ConfigError(why)
            code, out = await self._run(self.nft, "-f", "-", stdin=ruleset())
            if code != 0:
                raise errors.InfrastructureError(
                    f"cannot install the sandbox firewall (nftables): {out[-500:]}"
                )
            code, out = await self._run(self.ip, "addr", "replace", f"{PROXY_ADDRESS}/32", "dev", "lo")
            if code != 0:
                raise errors.InfrastructureError(f"cannot add the proxy address to lo: {out[-500:]}")
            self._host_ready = True

    async def route_many(self, wanted: dict[int, int], current: dict[int, int] | None = None) -> bool:
        """Route sandbox links (host-side interface index → proxy port) in one nftables
        transaction. ``current``: the map as the caller last saw it (listed again if stale);
        it is updated with what was routed, so the caller need not list it again. True
        when the map had to be listed again (the caller's copy was wrong: the caller should
        check what it believed about other entries)."""
        if not wanted:
            return False
        out = ""
        for attempt in range(2):
            if current is None or attempt:
                listed = await self.routes()
                if current is None:
                    current = listed
                else:
                    current.clear()
                    current.update(listed)
            code, out = await self._apply_routes(wanted, current)
            if code == 0:
                current.update(wanted)
                return attempt > 0
        raise errors.InfrastructureError(f"cannot route sandboxes to their proxies: {out[-300:]}")

    async def _apply_routes(self, wanted: dict[int, int], current: dict[int, int]) -> tuple[int, str]:
        lines = []
        for ifindex, port in wanted.items():
            if not PROXY_PORTS[0] <= port <= PROXY_PORTS[1]:
                raise errors.InvalidInput(f"proxy port {port} is outside {PROXY_PORTS}")
            if ifindex in current:
                lines.append(f"delete element inet {NAT_TABLE} proxy_of_link {{ {int(ifindex)} }}")
            lines.append(f"add element inet {NAT_TABLE} proxy_of_link {{ {int(ifindex)} : {int(port)} }}")
        return await self._run(self.nft, "-f", "-", stdin="\n".join(lines) + "\n")

    async def route(self, ifindex: int, port: int) -> None:
        await self.route_many({ifindex: port})

    async def unroute(self, ifindex: int) -> None:
        await self._run(
            self.nft, "delete", "element", "inet", NAT_TABLE, "proxy_of_link", f"{{ {int(ifindex)} }}"
        )

    async def routes(self) -> dict[int, int]:
        """Every interface index → proxy port on this host (entries of interfaces that
        are gone included; ``prune`` removes those)."""
        code, out = await self._run(self.nft, "-j", "list", "map", "inet", NAT_TABLE, "proxy_of_link")
        if code != 0:
            return {}
        found: dict[int, int] = {}
        for item in json.loads(out).get("nftables", []):
            for key, port in item.get("map", {}).get("elem", []):
                ifindex = _ifindex(str(key))
                if ifindex is not None:
                    found[ifindex] = int(port)
        return found

    @staticmethod
    def generation() -> int | None:
        """nftables' generation (changes with any change to the ruleset); None if unknown."""
        try:
            return netlink.nft_generation()
        except OSError:
            return None

    async def prune(self, routes: dict[int, int] | None = None) -> int:
        """Remove entries whose interface is gone (their sandbox stopped). ``routes``: the
        map just listed, if the caller has it; the removed entries leave it too."""
        present = _interfaces()
        if routes is None:
            routes = await self.routes()
        gone = [i for i in routes if i not in present]
        if gone:
            script = "".join(f"delete element inet {NAT_TABLE} proxy_of_link {{ {i} }}\n" for i in gone)
            await self._run(self.nft, "-f", "-", stdin=script)
            for i in gone:
                del routes[i]
        return len(gone)

    async def attach(self, token: str, pid: int) -> Slot:
        """Give the sandbox whose init is ``pid`` its veth and its one route (netlink
        requests from this process: no program run per sandbox)."""
        await self.ensure_host()
        return await asyncio.to_thread(self._attach, token, pid)

    def _attach(self, token: str, pid: int) -> Slot:
        rtnl = netlink.Rtnl()
        try:
            start = first_slot(token)
            for step in range(SLOTS):
                s = slot((start + step) % SLOTS)
                try:
                    rtnl.add_veth(s.host_if, "eth0", pid)
                    break
                except FileExistsError:
                    continue
                except OSError as exc:
                    raise errors.InfrastructureError(
                        f"cannot create the sandbox's network link: {exc}"
                    ) from exc
            else:
                raise errors.LimitExceeded("no free sandbox network slot (16383 in use)")
            try:
                ifindex = socket.if_nametoindex(s.host_if)
                disable_v6 = Path(f"/proc/sys/net/ipv6/conf/{s.host_if}/disable_ipv6")
                if disable_v6.exists():
                    disable_v6.write_text("1\n")
                rtnl.add_address(ifindex, s.host_ip, 30)
                rtnl.up(ifindex)
                netlink.inside(pid, functools.partial(_configure_inside, s))
            except OSError as exc:
                with contextlib.suppress(OSError):
                    rtnl.delete_link(s.host_if)
                raise errors.InfrastructureError(f"cannot configure the sandbox's network: {exc}") from exc
            return dataclasses.replace(s, ifindex=ifindex)
        finally:
            rtnl.close()


def _configure_inside(s: Slot, rtnl: netlink.Rtnl) -> None:
    """Inside the sandbox's network namespace: ``eth0``'s address, up, its one route."""
    eth0 = socket.if_nametoindex("eth0")
    rtnl.add_address(eth0, s.sandbox_ip, 30)
    rtnl.up(eth0)
    rtnl.add_route(PROXY_ADDRESS, 32, eth0, s.sandbox_ip)


def _ifindex(key: str) -> int | None:
    """An interface index from nft's listing (a number, or the name while it exists)."""
    if key.isdigit():
        return int(key)
    try:
        return int(Path(f"/sys/class/net/{key}/ifindex").read_text())
    except (OSError, ValueError):
        return None


def _interfaces() -> set[int]:
    """The indexes of this network namespace's interfaces (one netlink dump)."""
    return {index for index, _ in socket.if_nameindex()}
