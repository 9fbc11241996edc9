"""The proxy's front door: it owns the listening port and reads each connection's first
request head. A CONNECT to a host without a rule is a plain tunnel, so the front serves
it itself: it resolves and checks the destination exactly as the addon does
(:func:`resolve`: every address of the name must be allowed; the tunnel is pinned to the
first), answers ``200``, and relays the bytes with ``splice(2)``, in the kernel, without
copying them through Python. Everything else (a CONNECT to a host with a rule, plain
HTTP, anything it does not parse) goes unchanged to mitmproxy on its loopback port.

Why: mitmproxy relays a tunnel through its layers in 64 KiB reads; for a bulk download
that costs most of a core and well over half the throughput (bench/proxy.py).

Every connection is reported to the proxy's :class:`egress.Tracker` (opened, tunnelled or
refused and why, bytes each way as they move, closed); a connection handed to mitmproxy
is registered under the front's own address on that hop, so the addon's observations
land on the same record.

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
import ipaddress
import logging
import os
import re
import socket
import threading
from collections.abc import Callable

from sbx_proxy import config, egress, refusals

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


Own = frozenset[tuple[str, int]]
"""The proxy's own listening addresses (its front door and mitmproxy's loopback port)."""


def refusal(cfg: config.Config, address: str, port: int, own: Own = frozenset()) -> egress.Refusal | None:
    """Why connecting to ``address:port`` is refused, or None: the configured ranges, and
    never the proxy itself (allowed private ranges could include its own address: a
    request to itself would loop until the proxy runs out of descriptors)."""
    why = cfg.refusal(address)
    if why is None and _is_own(own, address, port):
        why = egress.Refusal(egress.Reason.PROXY_ITSELF, f"{address}:{port} is this proxy")
    return why


def _is_own(own: Own, address: str, port: int) -> bool:
    """Whether ``address:port`` is one of ``own`` (a listener on every address owns its
    port on all of them)."""
    address = address.split("%", 1)[0]
    return any(port == own_port and (address == host or _unspecified(host)) for host, own_port in own)


def _unspecified(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return not host


async def resolve(
    cfg: config.Config, host: str, port: int, own: Own = frozenset()
) -> tuple[str | None, egress.Refusal | None]:
    """(the address to connect to, None) or (None, why it is refused). Every address the
    name has must be allowed; the first is used (and pinned by the caller)."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        text = f"cannot resolve {host}: {type(exc).__name__}"
        return None, egress.Refusal(egress.Reason.UNRESOLVABLE, text)
    addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    for address in addresses:
        why = refusal(cfg, address, port, own)
        if why is not None:
            log.warning("sbx_proxy: refused %s:%s (%s)", host, port, why)
            return None, why
    if not addresses:
        return None, egress.Refusal(egress.Reason.UNRESOLVABLE, f"{host} has no address")
    return addresses[0], None


def parse_connect(head: bytes) -> tuple[str, int] | None:
    """The target of a well-formed ``CONNECT host:port`` head, else None."""
    found = _CONNECT.match(head)
    if found is None:
        return None
    port = int(found.group(2))
    if not 0 < port < 65536:
        return None
    return found.group(1).decode().strip("[]").lower(), port


class Front:
    def __init__(
        self,
        current_config: Callable[[], config.Config],
        inner: tuple[str, int],
        tracker: egress.Tracker | None = None,
    ) -> None:
        self.config = current_config
        self.inner = inner
        self.tracker = tracker or egress.Tracker()
        self.own: Own = frozenset({inner})
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
        self.own = frozenset({self.inner, (host, int(listener.getsockname()[1]))})
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
            client, peer = await loop.sock_accept(self.listener)
            client.setblocking(False)
            _no_delay(client)
            task = loop.create_task(self._serve(client, self.tracker.opened(_address(peer))))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _serve(self, client: socket.socket, conn: egress.Connection) -> None:
        loop = asyncio.get_running_loop()
        upstream: socket.socket | None = None
        head = bytearray()
        count = (
            self.tracker.counter(conn, egress.Direction.UP),
            self.tracker.counter(conn, egress.Direction.DOWN),
        )
        try:
            async with asyncio.timeout(HEAD_TIMEOUT):
                await self._read_head(client, head)
            raw = bytes(head)
            target = parse_connect(raw) if b"\r\n\r\n" in raw else None
            cfg = self.config()
            if target is not None and cfg.rule_for(*target) is None:
                upstream = await self._tunnel(client, raw, target, cfg, conn)
                if upstream is not None:
                    count[0](len(raw) - raw.index(b"\r\n\r\n") - 4)  # what came with the CONNECT
            else:  # mitmproxy decides (and checks) everything else
                upstream = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                upstream.setblocking(False)
                _no_delay(upstream)
                await loop.sock_connect(upstream, self.inner)
                self.tracker.handed(conn, upstream.getsockname())
                await loop.sock_sendall(upstream, raw)
                count[0](len(raw))
            if upstream is not None:
                if self.threaded < THREADED_MAX:
                    self.threaded += 1
                    try:
                        await relay_in_threads(client, upstream, count)
                    finally:
                        self.threaded -= 1
                else:
                    await relay(client, upstream, count)
        except TimeoutError:
            if head:  # a head begun and never finished
                self.tracker.refused(conn, egress.Reason.BAD_REQUEST)
        except OSError:
            pass
        finally:
            client.close()
            if upstream is not None:
                upstream.close()
            if conn.hop is not None and b"\r\n\r\n" in head and _unseen(conn):
                # A whole head handed over and nothing came of it: mitmproxy could not parse it.
                self.tracker.refused(conn, egress.Reason.BAD_REQUEST)
            self.tracker.closed(conn)

    @staticmethod
    async def _read_head(client: socket.socket, data: bytearray) -> None:
        """Into ``data``: bytes up to and including the end of the first request head (and
        whatever came with it), or up to HEAD_LIMIT when there is no end."""
        loop = asyncio.get_running_loop()
        while b"\r\n\r\n" not in data and len(data) < HEAD_LIMIT:
            chunk = await loop.sock_recv(client, HEAD_LIMIT)
            if not chunk:
                break
            data += chunk

    async def _tunnel(
        self,
        client: socket.socket,
        head: bytes,
        target: tuple[str, int],
        cfg: config.Config,
        conn: egress.Connection,
    ) -> socket.socket | None:
        loop = asyncio.get_running_loop()
        host, port = target
        conn.host, conn.port = host, port
        address, why = await resolve(cfg, host, port, self.own)
        if address is None:
            assert why is not None
            self.tracker.refused(conn, why)
            await loop.sock_sendall(client, refusals.head(refusals.answer(f"CONNECT {host}:{port}", why)))
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
            why = egress.Refusal(egress.Reason.UPSTREAM_FAILURE, f"cannot connect to {host}:{port}: {exc}")
            self.tracker.upstream_failed(conn, egress.Stage.CONNECT)
            self.tracker.refused(conn, why)
            await loop.sock_sendall(client, refusals.head(refusals.answer(f"CONNECT {host}:{port}", why)))
            return None
        self.tracker.routed(conn, egress.Mode.TUNNEL, host, port)
        await loop.sock_sendall(client, b"HTTP/1.1 200 Connection established\r\n\r\n")
        rest = head[head.index(b"\r\n\r\n") + 4 :]
        if rest:  # the client did not wait for the 200 (its TLS hello came along)
            await loop.sock_sendall(upstream, rest)
        return upstream


def _unseen(conn: egress.Connection) -> bool:
    return conn.mode is None and not conn.requests and not conn.refused


def _address(peer: object) -> tuple[str, int] | None:
    return (str(peer[0]), int(peer[1])) if isinstance(peer, tuple) and len(peer) >= 2 else None


Counters = tuple[Callable[[int], None], Callable[[int], None]]
"""Called with each count of bytes relayed: (a → b, b → a)."""


def _no_delay(sock: socket.socket) -> None:
    """Relayed bytes go out as they come (Nagle would hold a small write for an ACK that
    the peer delays: ~40 ms per request/response turn)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def relay(a: socket.socket, b: socket.socket, count: Counters | None = None) -> None:
    """Both directions until both ends are done; an end's EOF is passed on as a half-close.
    An error in either direction ends both."""
    one = asyncio.ensure_future(_pump(a, b, count[0] if count else None))
    two = asyncio.ensure_future(_pump(b, a, count[1] if count else None))
    try:
        for done in asyncio.as_completed((one, two)):
            try:
                await done
            except OSError:
                return
    finally:
        one.cancel()
        two.cancel()


async def relay_in_threads(a: socket.socket, b: socket.socket, count: Counters | None = None) -> None:
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

    def pump(src: socket.socket, dst: socket.socket, counted: Callable[[int], None] | None) -> None:
        try:
            _blocking_pump(src, dst, counted)
        except OSError:
            stop_both()
        finally:
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits
                loop.call_soon_threadsafe(one_ended)

    for sock in (a, b):
        sock.setblocking(True)
    ways = ((a, b, count[0] if count else None), (b, a, count[1] if count else None))
    for src, dst, counted in ways:
        threading.Thread(target=pump, args=(src, dst, counted), name="sbx-relay", daemon=True).start()
    try:
        await asyncio.shield(finished)
    except asyncio.CancelledError:
        stop_both()
        await asyncio.shield(finished)  # the threads end at once: their sockets are shut
        raise


def _blocking_pump(src: socket.socket, dst: socket.socket, counted: Callable[[int], None] | None) -> None:
    """src → dst through a pipe with blocking splice(2), then the EOF as a half-close."""
    r, w = os.pipe2(os.O_CLOEXEC)
    with contextlib.suppress(OSError):
        fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, PIPE_SIZE)
    try:
        while n := os.splice(src.fileno(), w, PIPE_SIZE, flags=os.SPLICE_F_MOVE):
            if counted is not None:
                counted(n)
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


async def _pump(src: socket.socket, dst: socket.socket, counted: Callable[[int], None] | None) -> None:
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
            if counted is not None:
                counted(n)
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
