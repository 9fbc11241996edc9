"""The runtime's netlink requests (shared/runtime/local/netlink.py) against the real
kernel: a veth pair into another process's network namespace, addresses, links up and a
route on both sides, as ``ip`` shows them; refusals as the kernel's errors; nftables
tables looked up without running ``nft``. Needs root."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess

import pytest

from shared.runtime.local import netlink, network

pytestmark = pytest.mark.needs_root


@pytest.fixture
def netns_holder():
    """A process in a network namespace of its own (as a sandbox's init is)."""
    proc = subprocess.Popen(["unshare", "--net", "--", "sleep", "60"])
    own = os.stat("/proc/self/ns/net").st_ino
    while os.stat(f"/proc/{proc.pid}/ns/net").st_ino == own:
        assert proc.poll() is None
    yield proc.pid
    proc.kill()
    proc.wait()


def ip_inside(pid: int, *args: str) -> str:
    argv = ["nsenter", f"--net=/proc/{pid}/ns/net", "--", "ip", *args]
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout


def test_a_veth_pair_into_another_namespace_with_addresses_and_a_route(netns_holder):
    pid, name = netns_holder, f"sbxt{os.getpid() % 100000}"
    ours = os.stat("/proc/thread-self/ns/net").st_ino
    rtnl = netlink.Rtnl()
    try:
        rtnl.add_veth(name, "eth0", pid)
        with pytest.raises(FileExistsError):  # a name in use is refused (the slot is taken)
            rtnl.add_veth(name, "eth0", pid)
        index = socket.if_nametoindex(name)
        rtnl.add_address(index, "10.213.250.1", 30)
        rtnl.up(index)

        def configure(inner: netlink.Rtnl) -> int:
            eth0 = socket.if_nametoindex("eth0")  # looked up in the sandbox's namespace
            inner.add_address(eth0, "10.213.250.2", 30)
            inner.up(eth0)
            inner.add_route(network.PROXY_ADDRESS, 32, eth0, "10.213.250.2")
            return eth0

        assert netlink.inside(pid, configure) > 0
        host = subprocess.run(["ip", "-o", "-4", "addr", "show", name], capture_output=True, text=True).stdout
        assert "inet 10.213.250.1/30" in host
        link = subprocess.run(["ip", "-o", "link", "show", name], capture_output=True, text=True).stdout
        assert "state UP" in link or ",UP" in link, link
        assert "inet 10.213.250.2/30" in ip_inside(pid, "-o", "-4", "addr", "show", "eth0")
        route = ip_inside(pid, "route", "show", network.PROXY_ADDRESS)
        assert f"{network.PROXY_ADDRESS} dev eth0 scope link src 10.213.250.2" in route
        # Only the helper thread joined the sandbox's namespace; this one never did.
        assert os.stat("/proc/thread-self/ns/net").st_ino == ours
        rtnl.delete_link(name)  # both ends go
        assert not os.path.exists(f"/sys/class/net/{name}")
        assert "eth0" not in ip_inside(pid, "-o", "link")
    finally:
        if os.path.exists(f"/sys/class/net/{name}"):
            rtnl.delete_link(name)
        rtnl.close()


def test_refusals_are_the_kernels_errors_and_a_gone_namespace_is_said(netns_holder):
    rtnl = netlink.Rtnl()
    try:
        with pytest.raises(OSError) as refused:
            rtnl.add_address(2**31 - 1, "10.213.250.5", 30)  # no such link
        assert refused.value.errno == 19  # ENODEV
    finally:
        rtnl.close()
    with pytest.raises(FileNotFoundError):
        netlink.inside(2**22 + 12345, lambda r: None)  # no such process


@pytest.mark.serial  # the host's tables, which serial tests delete and restore
def test_nftables_tables_are_looked_up_without_running_nft():
    asyncio.run(network.Network().ensure_host())
    assert netlink.nft_table_exists(network.TABLE) and netlink.nft_table_exists(network.NAT_TABLE)
    assert not netlink.nft_table_exists("no_such_table_here")
