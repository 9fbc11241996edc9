"""The few netlink requests a sandbox's veth pair needs, made from this process.

``ip link add … netns PID``, ``ip addr add``, ``ip link set … up``, ``ip route add``,
``nft list table`` and nftables' generation, as netlink messages on an ``AF_NETLINK``
socket (no program run per sandbox, and no dependency: each request is a header, a
fixed struct and a few attributes, answered by an acknowledgement). Requests inside a
sandbox's network namespace go through a socket opened there: a thread of its own joins
the namespace (``setns`` applies to the calling thread only), opens the socket and ends,
so no other work ever runs in that namespace.
"""

from __future__ import annotations

import ctypes
import ipaddress
import itertools
import os
import socket
import struct
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

NETLINK_ROUTE, NETLINK_NETFILTER = 0, 12
NFT_MSG_GETTABLE = (10 << 8) | 1  # nf_tables subsystem, get table
NFT_MSG_GETGEN, NFT_MSG_NEWGEN = (10 << 8) | 16, (10 << 8) | 15  # the ruleset's generation
NFTA_TABLE_NAME, NFPROTO_INET, NFTA_GEN_ID = 1, 1, 1
RTM_NEWLINK, RTM_DELLINK, RTM_NEWADDR, RTM_NEWROUTE = 16, 17, 20, 24
NLM_F_REQUEST, NLM_F_ACK, NLM_F_EXCL, NLM_F_CREATE = 0x1, 0x4, 0x200, 0x400
NLMSG_ERROR = 2
IFLA_IFNAME, IFLA_LINKINFO, IFLA_NET_NS_PID = 3, 18, 19
IFLA_INFO_KIND, IFLA_INFO_DATA, VETH_INFO_PEER = 1, 2, 1
IFA_ADDRESS, IFA_LOCAL = 1, 2
RTA_DST, RTA_OIF, RTA_PREFSRC = 1, 4, 7
IFF_UP = 0x1
RT_TABLE_MAIN, RTPROT_BOOT, RT_SCOPE_LINK, RTN_UNICAST = 254, 3, 253, 1
CLONE_NEWNET = 0x40000000

_IFINFO = struct.Struct("=BxHiII")  # family, type, index, flags, change
_IFADDR = struct.Struct("=BBBBi")  # family, prefix length, flags, scope, index
_RTMSG = struct.Struct("=BBBBBBBBI")  # family, dst len, src len, tos, table, protocol, scope, type, flags
_HEADER = struct.Struct("=IHHII")  # length, type, flags, sequence, port
_libc = ctypes.CDLL(None, use_errno=True)
_sequence = itertools.count(1)


def attr(kind: int, data: bytes) -> bytes:
    """One attribute (length, type, value), padded to four bytes."""
    head = struct.pack("=HH", 4 + len(data), kind)
    return head + data + b"\0" * (-len(data) % 4)


def _name(text: str) -> bytes:
    return text.encode() + b"\0"


class Rtnl:
    """A netlink socket (route, or ``protocol``) of the namespace it was opened in."""

    def __init__(self, protocol: int = NETLINK_ROUTE) -> None:
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, protocol)
        self.sock.bind((0, 0))

    def close(self) -> None:
        self.sock.close()

    def request(self, kind: int, body: bytes, flags: int = 0) -> None:
        """Send one request and wait for its acknowledgement; OSError with the kernel's
        errno if it refused."""
        seq = next(_sequence)
        flags |= NLM_F_REQUEST | NLM_F_ACK
        self.sock.send(_HEADER.pack(_HEADER.size + len(body), kind, flags, seq, 0) + body)
        while True:
            data = self.sock.recv(65536)
            offset = 0
            while offset + _HEADER.size <= len(data):
                length, mtype, _, mseq, _ = _HEADER.unpack_from(data, offset)
                if mtype == NLMSG_ERROR and mseq == seq:
                    (code,) = struct.unpack_from("=i", data, offset + _HEADER.size)
                    if code:
                        raise OSError(-code, os.strerror(-code))
                    return
                offset += max(length, _HEADER.size) + (-length % 4)

    def add_veth(self, name: str, peer: str, peer_pid: int) -> None:
        """A veth pair: ``name`` here, ``peer`` in the network namespace of ``peer_pid``
        (FileExistsError if ``name`` is taken)."""
        peer_info = _IFINFO.pack(socket.AF_UNSPEC, 0, 0, 0, 0)
        peer_info += attr(IFLA_IFNAME, _name(peer)) + attr(IFLA_NET_NS_PID, struct.pack("=I", peer_pid))
        info = attr(IFLA_INFO_KIND, b"veth") + attr(IFLA_INFO_DATA, attr(VETH_INFO_PEER, peer_info))
        body = _IFINFO.pack(socket.AF_UNSPEC, 0, 0, 0, 0) + attr(IFLA_IFNAME, _name(name))
        body += attr(IFLA_LINKINFO, info)
        self.request(RTM_NEWLINK, body, NLM_F_CREATE | NLM_F_EXCL)

    def delete_link(self, name: str) -> None:
        self.request(RTM_DELLINK, _IFINFO.pack(socket.AF_UNSPEC, 0, 0, 0, 0) + attr(IFLA_IFNAME, _name(name)))

    def add_address(self, index: int, address: str, prefix: int) -> None:
        packed = ipaddress.IPv4Address(address).packed
        body = _IFADDR.pack(socket.AF_INET, prefix, 0, 0, index)
        body += attr(IFA_LOCAL, packed) + attr(IFA_ADDRESS, packed)
        self.request(RTM_NEWADDR, body, NLM_F_CREATE | NLM_F_EXCL)

    def up(self, index: int) -> None:
        self.request(RTM_NEWLINK, _IFINFO.pack(socket.AF_UNSPEC, 0, index, IFF_UP, IFF_UP))

    def add_route(self, destination: str, prefix: int, index: int, source: str) -> None:
        """A route to ``destination/prefix`` through the link ``index`` (scope link, no
        gateway), from ``source``."""
        scope, kind = RT_SCOPE_LINK, RTN_UNICAST
        body = _RTMSG.pack(socket.AF_INET, prefix, 0, 0, RT_TABLE_MAIN, RTPROT_BOOT, scope, kind, 0)
        body += attr(RTA_DST, ipaddress.IPv4Address(destination).packed)
        body += attr(RTA_OIF, struct.pack("=I", index))
        body += attr(RTA_PREFSRC, ipaddress.IPv4Address(source).packed)
        self.request(RTM_NEWROUTE, body, NLM_F_CREATE | NLM_F_EXCL)


def nft_table_exists(name: str, family: int = NFPROTO_INET) -> bool:
    """Whether nftables has the table (``nft list table inet NAME`` succeeds)."""
    nft = Rtnl(NETLINK_NETFILTER)
    try:
        nft.request(NFT_MSG_GETTABLE, struct.pack("=BBH", family, 0, 0) + attr(NFTA_TABLE_NAME, _name(name)))
        return True
    except FileNotFoundError:
        return False
    finally:
        nft.close()


def nft_generation() -> int:
    """nftables' generation: a number that changes with every change to the ruleset
    (a table, a rule, a map element), whoever made it: one netlink request."""
    nft = Rtnl(NETLINK_NETFILTER)
    try:
        seq = next(_sequence)
        body = struct.pack("=BBH", socket.AF_UNSPEC, 0, 0)
        nft.sock.send(_HEADER.pack(_HEADER.size + len(body), NFT_MSG_GETGEN, NLM_F_REQUEST, seq, 0) + body)
        for _ in range(16):  # (the answer, perhaps after stray messages)
            data = nft.sock.recv(65536)
            offset = 0
            while offset + _HEADER.size <= len(data):
                length, mtype, _, mseq, _ = _HEADER.unpack_from(data, offset)
                if mseq == seq and mtype == NLMSG_ERROR:
                    (code,) = struct.unpack_from("=i", data, offset + _HEADER.size)
                    raise OSError(-code, os.strerror(-code))
                if mseq == seq and mtype == NFT_MSG_NEWGEN:
                    at, end = offset + _HEADER.size + 4, offset + length  # (after the nfgenmsg)
                    while at + 4 <= end:
                        size, kind = struct.unpack_from("=HH", data, at)
                        if kind == NFTA_GEN_ID and size >= 8:
                            return int(struct.unpack_from(">I", data, at + 4)[0])
                        at += max(size, 4) + (-size % 4)
                    raise OSError("nftables' generation message has no id")
                offset += max(length, _HEADER.size) + (-length % 4)
        raise OSError("nftables did not say its generation")
    finally:
        nft.close()


def inside(pid: int, work: Callable[[Rtnl], T]) -> T:
    """``work(rtnl)`` with a socket of the network namespace of ``pid`` (and interface
    names looked up there), in a thread that joins that namespace and then ends."""
    result: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            try:
                if _libc.setns(fd, CLONE_NEWNET) != 0:
                    code = ctypes.get_errno()
                    raise OSError(code, f"setns into the sandbox's network: {os.strerror(code)}")
            finally:
                os.close(fd)
            rtnl = Rtnl()
            try:
                result.append(work(rtnl))
            finally:
                rtnl.close()
        except BaseException as exc:  # handed to the caller
            failure.append(exc)

    thread = threading.Thread(target=run, name=f"netns-{pid}", daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]
