"""Proxy-only egress on the local runtime, attacked from inside real sandboxes: the
assigned proxy (a real mitmdump) is the only way out, and credentials are injected
there, never visible inside."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import socket
import threading

import pytest

from shared.runtime import api
from shared.runtime.local import network
from shared.runtime.local import runtime as local
from tests.proxy import harness

pytestmark = [
    pytest.mark.needs_root("veth pairs and nftables need root"),
    pytest.mark.skipif(network.Network().unavailable() is not None, reason="ip/nft missing"),
    pytest.mark.slow,
    pytest.mark.serial,  # deletes the host's filter table and counts every host link
]
TOKEN = "ghp_" + "egressTestToken" * 3


class HostServers:
    """A TCP and a UDP listener on 0.0.0.0 of the host: what a sandbox must never reach."""

    def __init__(self) -> None:
        self.tcp = socket.create_server(("0.0.0.0", 0))
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind(("0.0.0.0", 0))
        self.udp.settimeout(0.2)
        self.tcp_port, self.udp_port = self.tcp.getsockname()[1], self.udp.getsockname()[1]
        self.heard: list[str] = []
        self.tcp.settimeout(0.2)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._listen, daemon=True)
        self.thread.start()

    def _listen(self) -> None:
        while not self.stop.is_set():
            with contextlib.suppress(OSError):
                conn, peer = self.tcp.accept()
                self.heard.append(f"tcp from {peer}")
                conn.close()
            with contextlib.suppress(OSError):
                _, peer = self.udp.recvfrom(100)
                self.heard.append(f"udp from {peer}")

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.tcp.close()
        self.udp.close()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("egress")
    pki = harness.PKI(tmp / "pki")
    upstream = harness.Upstream(pki)
    git_root = tmp / "srv"
    seed = tmp / "seed"
    (git_root / "org").mkdir(parents=True)
    ident = {
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@e",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@e",
    }
    import subprocess

    subprocess.run(["git", "init", "-q", "-b", "main", str(seed)], check=True)
    (seed / "README").write_text("from the host\n")
    subprocess.run(["git", "add", "."], cwd=seed, check=True)
    subprocess.run(["git", "commit", "-qm", "seed"], cwd=seed, check=True, env={**os.environ, **ident})
    bare = git_root / "org" / "repo.git"
    subprocess.run(["git", "clone", "-q", "--bare", str(seed), str(bare)], check=True)
    subprocess.run(["git", "config", "http.receivepack", "true"], cwd=bare, check=True)
    git_server = harness.Upstream(pki, harness.GitSmartHTTP)
    git_server.server.token, git_server.server.root = TOKEN, git_root
    index = harness.Upstream(pki, harness.PackageIndex)
    index.server.token, index.server.wheel = TOKEN, harness.demo_wheel()
    port = network.PROXY_PORTS[1] - harness.free_port() % 20  # away from the ports a fleet takes first
    rt = local.LocalRuntime(tmp / "state", egress="proxy")
    import asyncio

    asyncio.run(rt.network.ensure_host())
    config = f"""
[destinations]
allow = ["127.0.0.1/32"]

[[rules]]
name = "github"
kind = "bearer"
hosts = ["github.com:{upstream.port}"]
token_env = "SBX_TEST_TOKEN"

[[rules]]
name = "github-git"
kind = "basic"
hosts = ["github.com:{git_server.port}"]
username = "x-access-token"
password_env = "SBX_TEST_TOKEN"

[[rules]]
name = "private-index"
kind = "bearer"
hosts = ["gitlab.example:{index.port}"]
token_env = "SBX_TEST_TOKEN"
"""
    proxy = harness.Proxy(
        tmp / "proxy",
        config,
        pki.ca_cert,
        {"github.com": "127.0.0.1", "gitlab.example": "127.0.0.1"},
        env={"SBX_TEST_TOKEN": TOKEN},
        listen_host=network.PROXY_ADDRESS,
        port=port,
    )
    rt.egress_links.proxy_ca = proxy.ca_cert
    rt.test_proxy_port = port
    servers = HostServers()
    rt.test_git_port = git_server.port
    rt.test_git_root = git_root
    rt.test_index = index
    yield rt, upstream, proxy, servers
    index.close()
    git_server.close()
    servers.close()
    proxy.close()
    upstream.close()
    assert TOKEN not in proxy.output()


@pytest.fixture
async def sandboxes(world):
    rt = world[0]
    made = []

    async def make(name: str) -> str:
        await rt.create(api.SandboxSpec(sandbox_id=name))
        await rt.start(name)
        made.append(name)
        # What the proxy-scaler does for a new sandbox: route it to a proxy of the fleet.
        await rt.network.route(rt.egress_link(name), rt.test_proxy_port)
        return name

    yield make
    for name in made:
        await rt.delete(name)


async def sh(rt, sandbox: str, script: str, timeout: float = 30) -> tuple[int, str]:
    result, out, err = await rt.run(sandbox, ["/bin/bash", "-c", script], timeout=timeout)
    return result.exit_code, (out + err).decode(errors="replace")


async def test_the_proxy_is_the_way_out_and_injects_what_the_sandbox_never_sees(world, sandboxes):
    rt, upstream, proxy, _ = world
    box = await sandboxes("egress-a")
    code, out = await sh(rt, box, f"curl -sS --max-time 20 https://github.com:{upstream.port}/echo")
    assert code == 0, out
    assert upstream.seen[-1]["headers"]["Authorization"] == f"Bearer {TOKEN}"
    assert TOKEN not in out
    code, out = await sh(rt, box, "env")
    assert TOKEN not in out and f"HTTPS_PROXY={network.proxy_url()}" in out
    assert "GIT_TERMINAL_PROMPT=0" in out
    code, out = await sh(
        rt, box, "cat /etc/sbx/* /etc/ssl/certs/ca-certificates.crt | grep -c 'PRIVATE KEY' || true"
    )
    assert out.strip() == "0", "only the CA's certificate is inside"
    code, out = await sh(rt, box, f"ls {proxy.confdir} 2>&1; ls /proc/1/root/etc 2>&1 | head -3")
    assert "mitmproxy-ca.pem" not in out


async def test_direct_egress_that_bypasses_the_proxy_fails(world, sandboxes):
    rt, upstream, _, servers = world
    box = await sandboxes("egress-b")
    code, out = await sh(rt, box, "ip -4 -o addr show eth0; ip route")
    mine = ipaddress.ip_address(out.split()[3].split("/")[0])
    host_ip = str(mine - 1)  # the host's end of this sandbox's /30
    attempts = {
        "unset proxy variables": f"env -u HTTPS_PROXY -u https_proxy curl -sS --max-time 3 https://github.com:{upstream.port}/",
        "raw public IP": "curl -sS --noproxy '*' --max-time 3 http://1.1.1.1/",
        "the host's veth address": f"curl -sS --noproxy '*' --max-time 3 http://{host_ip}:{servers.tcp_port}/",
        "the proxy address, another port": f"curl -sS --noproxy '*' --max-time 3 http://{network.PROXY_ADDRESS}:{servers.tcp_port}/",
        "metadata": "curl -sS --noproxy '*' --max-time 3 http://169.254.169.254/",
        "DNS": "getent hosts github.com",
        "the proxy to a loopback target": f"curl -sS --max-time 5 -o /dev/null -w '%{{http_code}}' http://127.0.0.2:{servers.tcp_port}/",
    }  # fmt: skip
    for what, command in attempts.items():
        code, out = await sh(rt, box, command)
        assert code != 0 or out.strip() in ("502", ""), f"{what} worked: {out}"
    for target in (host_ip, network.PROXY_ADDRESS):
        await sh(rt, box, f"echo x > /dev/udp/{target}/{servers.udp_port}")
    code, out = await sh(rt, box, "ping -c1 -W1 " + host_ip + " 2>&1 || true")
    assert " 0% packet loss" not in out
    import asyncio

    await asyncio.sleep(0.5)
    assert servers.heard == [], "nothing from the sandbox reached host services"

    # Control: with a rule accepting exactly that attempt ahead of the firewall's, the same
    # attempt does reach the host, so the test above measured the firewall, not a missing
    # route. (A rule, not the table deleted: any stack's proxy-scaler on the host puts a
    # deleted table back within a round.)
    import re
    import subprocess

    rule = ["inet", network.TABLE, "input", "ip", "daddr", host_ip, "tcp", "dport", str(servers.tcp_port)]
    added = subprocess.run(
        ["nft", "-e", "-a", "insert", "rule", *rule, "accept"], check=True, capture_output=True, text=True
    )
    handle = re.search(r"# handle (\d+)", added.stdout)
    assert handle, added.stdout
    try:
        await sh(rt, box, f"curl -sS --noproxy '*' --max-time 3 http://{host_ip}:{servers.tcp_port}/")
        await asyncio.sleep(0.3)
        assert any(h.startswith("tcp") for h in servers.heard), "control: reachable without the firewall"
    finally:
        subprocess.run(
            ["nft", "delete", "rule", "inet", network.TABLE, "input", "handle", handle.group(1)], check=True
        )
    servers.heard.clear()


async def test_sandboxes_cannot_reach_each_other_and_links_go_with_the_sandbox(world, sandboxes):
    import socket
    import subprocess

    def links() -> set[str]:
        out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        return {line.split(":")[1].split("@")[0].strip() for line in out.splitlines() if "sbxh" in line}

    rt = world[0]
    before = links()
    a, b = await sandboxes("egress-c"), await sandboxes("egress-d")
    # The links these two made (other sandboxes on the machine may make theirs meanwhile).
    mine = {socket.if_indextoname(rt.egress_link(s) or 0) for s in (a, b)}
    assert mine <= links() - before
    _, out = await sh(rt, b, "ip -4 -o addr show eth0")
    b_ip = out.split()[3].split("/")[0]
    await sh(rt, b, "setsid python3 -m http.server 8000 --bind 0.0.0.0 >/dev/null 2>&1 < /dev/null &")
    wait_up = (
        "for i in $(seq 50); do "
        "curl -s --noproxy '*' http://127.0.0.1:8000/ >/dev/null && echo up && break; sleep 0.1; done"
    )
    _, out = await sh(rt, b, wait_up)
    assert "up" in out, "the server runs inside b; only the path between sandboxes is closed"
    code, out = await sh(rt, a, f"curl -sS --noproxy '*' --max-time 3 http://{b_ip}:8000/")
    assert code != 0, out
    assert len(mine) == 2
    await rt.stop(a)
    await rt.stop(b)
    for _ in range(100):  # the kernel frees a namespace's links shortly after its last process
        if not links() & mine:
            break
        await asyncio.sleep(0.05)
    assert not links() & mine


async def test_a_sandbox_without_a_route_is_refused_at_once_and_routes_follow_assignment(world, sandboxes):
    """Nothing listens on the port sandboxes are given: an unassigned sandbox's connection
    is reset at once (no hang), and moving it to another proxy changes nothing inside."""
    rt, upstream, proxy, _ = world
    box = await sandboxes("egress-e")
    link = rt.egress_link(box)
    assert (await rt.network.routes())[link] == rt.test_proxy_port
    code, out = await sh(
        rt, box, f"curl -sS --noproxy '*' --max-time 3 http://{network.PROXY_ADDRESS}:{rt.test_proxy_port}/"
    )
    assert code != 0, "a proxy's own port is reachable only through the sandbox's assignment"
    await rt.network.unroute(link)
    code, out = await sh(rt, box, f"curl -sS --max-time 5 https://github.com:{upstream.port}/echo")
    assert code == 7, out  # refused (curl's 7), not a timeout (28): no hang
    await rt.network.route(link, rt.test_proxy_port)
    code, out = await sh(rt, box, f"curl -sS --max-time 20 https://github.com:{upstream.port}/echo")
    assert code == 0, out


async def test_a_sandbox_clones_and_pushes_with_a_credential_it_never_sees(world, sandboxes):
    """git inside a real sandbox, with nothing but what the runtime gives it (proxy
    variables, the CA bundle, GIT_TERMINAL_PROMPT=0): clone and push work because the
    proxy adds the credential; no credential is anywhere in the sandbox afterwards."""
    import subprocess

    rt = world[0]
    box = await sandboxes("egress-git")
    url = f"https://github.com:{rt.test_git_port}/org/repo.git"
    script = (
        "set -e; cd /workspace; git clone -q " + url + " repo; cd repo; cat README; "
        "git -c user.name=agent -c user.email=agent@example.com "
        "commit -q --allow-empty -m 'from the sandbox'; "
        "git push -q origin main; grep -rl " + TOKEN + " /workspace /root /tmp /etc 2>/dev/null | wc -l"
    )
    code, out = await sh(rt, box, script, timeout=120)
    assert code == 0, out
    assert out.splitlines()[0] == "from the host" and out.splitlines()[-1] == "0"
    log = subprocess.run(
        ["git", "log", "--format=%s", "main"],
        cwd=rt.test_git_root / "org" / "repo.git",
        capture_output=True,
        text=True,
    )
    assert log.stdout.split("\n")[0] == "from the sandbox"


async def test_a_sandbox_installs_from_a_private_index_with_a_credential_it_never_sees(world, sandboxes):
    """pip inside a real sandbox, with nothing but what the runtime gives it (proxy
    variables, the CA bundle in PIP_CERT): the index wants a token, the proxy adds it."""
    rt = world[0]
    box = await sandboxes("egress-pip")
    code, out = await sh(rt, box, "python3 -m pip --version")
    if code != 0:
        pytest.skip(f"the sandbox image has no pip: {out[:200]}")
    index = rt.test_index
    code, out = await sh(
        rt,
        box,
        "python3 -m pip install -q --disable-pip-version-check --no-cache-dir --target /tmp/site "
        f"--index-url https://gitlab.example:{index.port}/simple/ sbxdemo && "
        "python3 -c 'import sys; sys.path.insert(0, \"/tmp/site\"); import sbxdemo; print(sbxdemo.GREETING)'",
        timeout=120,
    )
    assert code == 0 and "installed through the proxy" in out, out
    assert {s["auth"] for s in index.seen} == {f"Bearer {TOKEN}"}, "every request carried the token"
    code, out = await sh(
        rt, box, f"env; cat /tmp/site -r 2>/dev/null; grep -r {TOKEN} /tmp/site || echo clean"
    )
    assert TOKEN not in out.replace(f"grep -r {TOKEN}", "") and out.strip().endswith("clean")
