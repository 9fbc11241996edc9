"""The proxy's front door: it owns the listening port and reads each connection's first
request head. A CONNECT to a host without a rule is a plain tunnel, so the front serves
it itself: it resolves and checks the destination exactly as the addon does
(:func:`resolve`: every address of the name must be allowed; the tunnel is pinned to the
first), answers ``200``, and relays the bytes with ``splice(2)``, in the kernel, without
copying them through Python. Everything else (a CONNECT to a host with a rule, plain
HTTP, anything it does not parse) goes unchanged to mitmproxy on its loopback port.

Why: mitmproxy relays a tunnel through its layers in 64 KiB reads; for a bulk download
that costs most of a core and well over half the throughput (bench/proxy.py).

Each direction of a relayed connection is a blocking ``splice(2)`` loop in a thread of its
own (two threads per connection, up to ``THREADED_MAX`` connections): the kernel wakes
the thread when bytes arrive, with no event-loop round per chunk (an event-loop relay
re-arms its reader for every chunk, which cost most of the proxy's CPU per GiB). Beyond
that many connections at once, the event loop relays the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import re
import socket
import threading
from collections.abc import Callable

from sbx_proxy import config

log = logging.getLogger("sbx_proxy")
HEAD_LIMIT = 16 * 1024
HEAD_TIMEOUT = 30.0
CONNECT_TIMEOUT = 30.0
PIPE_SIZE = 1 << 20
THREADED_MAX = 256
"""Connections relayed by threads at once (two each); more are relayed by the event loop."""
FLAGS = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK
_CONNECT = re.compile(
    rb"CONNECT ([A-Za-z0-9._-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\]):([0-9]{1,5}) HTTP/1\.[01]\r\n"
)


async def resolve(cfg: config.Config, host: str, port: int) -> tuple[str | None, str | None]:
    """(the address to connect to, None) or (None, why it is refused). Every address the
    name has must be allowed; the first is used (and pinned by the caller)."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        return None, f"cannot resolve {host}: {type(exc).__name__}"
    addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    for address in addresses:
        why = cfg.refusal(address)
        if why is not None:
            log.warning("sbx_proxy: refused %s:%s (%s)", host, port, why)
            return None, why
    return (addresses[0], None) if addresses else (None, f"{host} has no address")


def parse_connect(head: bytes) -> tuple[str, int] | None:
    """The target of a well-formed ``CONNECT host:port`` head, else None."""
    found = _CONNECT.match(head)
    if found is None:
        return None
    port = int(found.group(2))
    if not 0 < port < 65536:
        return None
    return found.group(1).decode().strip("[]").lower(), port


def _reply(status: str, body: str = "") -> bytes:
    text = body.encode()
    return (
        f"HTTP/1.1 {status}\r\ncontent-type: text/plain\r\ncontent-length: {len(text)}\r\n"
        f"connection: close\r\n\r\n"
    ).encode() + text


class Front:
    def __init__(self, current_config: Callable[[], config.Config], inner: tuple[str, int]) -> None:
        self.config = current_config
        self.inner = inner
        self.tasks: set[asyncio.Task[None]] = set()
        self.threaded = 0
        """Connections relayed by threads now."""
        self.listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None

    async def start(self, host: str, port: int) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(1024)
        listener.setblocking(False)
        self.listener = listener
        self._accepting = asyncio.get_running_loop().create_task(self._accept())

    async def close(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
        for task in list(self.tasks):
            task.cancel()
        if self.listener is not None:
            self.listener.close()

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        assert self.listener is not None
        while True:
            client, _ = await loop.sock_accept(self.listener)
            client.setblocking(False)
            _no_delay(client)
            task = loop.create_task(self._serve(client))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _serve(self, client: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        upstream: socket.socket | None = None
        try:
            async with asyncio.timeout(HEAD_TIMEOUT):
                head = await self._read_head(client)
            target = parse_connect(head) if b"\r\n\r\n" in head else None
            cfg = self.config()
            if target is not None and cfg.rule_for(*target) is None:
                upstream = await self._tunnel(client, head, target, cfg)
            else:  # mitmproxy decides (and checks) everything else
                upstream = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                upstream.setblocking(False)
                _no_delay(upstream)
                await loop.sock_connect(upstream, self.inner)
                await loop.sock_sendall(upstream, head)
            if upstream is not None:
                if self.threaded < THREADED_MAX:
                    self.threaded += 1
                    try:
                        await relay_in_threads(client, upstream)
                    finally:
                        self.threaded -= 1
                else:
                    await relay(client, upstream)
        except (TimeoutError, OSError):
            pass
        finally:
            client.close()
            if upstream is not None:
                upstream.close()

    @staticmethod
    async def _read_head(client: socket.socket) -> bytes:
        """Bytes up to and including the end of the first request head (and whatever
        came with it), or up to HEAD_LIMIT when there is no end."""
        loop = asyncio.get_running_loop()
        data = b""
        while b"\r\n\r\n" not in data and len(data) < HEAD_LIMIT:
            chunk = await loop.sock_recv(client, HEAD_LIMIT)
            if not chunk:
                break
            data += chunk
        return data

    async def _tunnel(
        self, client: socket.socket, head: bytes, target: tuple[str, int], cfg: config.Config
    ) -> socket.socket | None:
        loop = asyncio.get_running_loop()
        host, port = target
        address, why = await resolve(cfg, host, port)
        if address is None:
            await loop.sock_sendall(client, _reply("403 Forbidden", f"destination refused: {why}\n"))
            return None
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        upstream = socket.socket(family, socket.SOCK_STREAM)
        upstream.setblocking(False)
        _no_delay(upstream)
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT):
                await loop.sock_connect(upstream, (address, port))
        except (TimeoutError, OSError) as exc:
            upstream.close()
            why = f"cannot connect to {host}:{port}: {exc}\n"
            await loop.sock_sendall(client, _reply("502 Bad Gateway", why))
            return None
        await loop.sock_sendall(client, b"HTTP/1.1 200 Connection established\r\n\r\n")
        rest = head[head.index(b"\r\n\r\n") + 4 :]
        if rest:  # the client did not wait for the 200 (its TLS hello came along)
            await loop.sock_sendall(upstream, rest)
        return upstream


def _no_delay(sock: socket.socket) -> None:
    """Relayed bytes go out as they come (Nagle would hold a small write for an ACK that
    the peer delays: ~40 ms per request/response turn)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def relay(a: socket.socket, b: socket.socket) -> None:
    """Both directions until both ends are done; an end's EOF is passed on as a half-close.
    An error in either direction ends both."""
    one = asyncio.ensure_future(_pump(a, b))
    two = asyncio.ensure_future(_pump(b, a))
    try:
        for done in asyncio.as_completed((one, two)):
            try:
                await done
            except OSError:
                return
    finally:
        one.cancel()
        two.cancel()


async def relay_in_threads(a: socket.socket, b: socket.socket) -> None:
    """What :func:`relay` does, each direction a blocking splice loop in a thread of its
    own. Cancelled, or when one direction fails, both sockets are shut down, which ends
    both threads; returns once both have."""
    loop = asyncio.get_running_loop()
    finished = loop.create_future()
    left = [2]

    def stop_both() -> None:
        for sock in (a, b):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def one_ended() -> None:
        left[0] -= 1
        if left[0] == 0 and not finished.done():
            finished.set_result(None)

    def pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            _blocking_pump(src, dst)
        except OSError:
            stop_both()
        finally:
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits
                loop.call_soon_threadsafe(one_ended)

    for sock in (a, b):
        sock.setblocking(True)
    for src, dst in ((a, b), (b, a)):
        threading.Thread(target=pump, args=(src, dst), name="sbx-relay", daemon=True).start()
    try:
        await asyncio.shield(finished)
    except asyncio.CancelledError:
        stop_both()
        await asyncio.shield(finished)  # the threads end at once: their sockets are shut
        raise


def _blocking_pump(src: socket.socket, dst: socket.socket) -> None:
    """src → dst through a pipe with blocking splice(2), then the EOF as a half-close."""
    r, w = os.pipe2(os.O_CLOEXEC)
    with contextlib.suppress(OSError):
        fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, PIPE_SIZE)
    try:
        while n := os.splice(src.fileno(), w, PIPE_SIZE, flags=os.SPLICE_F_MOVE):
            while n:
                n -= os.splice(r, dst.fileno(), n, flags=os.SPLICE_F_MOVE)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)
    finally:
        os.close(r)
        os.close(w)


async def _wait(sock: socket.socket, *, readable: bool) -> None:
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    fd = sock.fileno()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    (loop.add_reader if readable else loop.add_writer)(fd, wake)
    try:
        await ready
    finally:
        (loop.remove_reader if readable else loop.remove_writer)(fd)


async def _pump(src: socket.socket, dst: socket.socket) -> None:
    """src → dst through a pipe with splice(2): the bytes never enter user space."""
    r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    with contextlib.suppress(OSError):
        fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, PIPE_SIZE)
    try:
        while True:
            try:
                n = os.splice(src.fileno(), w, PIPE_SIZE, flags=FLAGS)
            except BlockingIOError:
                await _wait(src, readable=True)
                continue
            if n == 0:
                break
            while n:
                try:
                    n -= os.splice(r, dst.fileno(), n, flags=FLAGS)
                except BlockingIOError:
                    await _wait(dst, readable=False)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)
    finally:
        os.close(r)
        os.close(w)
