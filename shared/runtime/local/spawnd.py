"""The spawner: a small process of the executor's that starts every command of
``runtime.exec`` (``spawner.py`` is its client).

Starting a command means running Python between fork and exec (``enter.py``: the
cgroup, the namespaces, the bounding set, the uid, no-new-privileges, the seccomp
filter, the fork into the pid namespace), and a fork costs what the forking process
maps: about 3.7 ms of CPU from a 50 MB executor, 0.5 ms from this process, which
imports only a few standard modules (``python -I -S``: no site, no environment).

It is started once per executor (the base interpreter with ``-I -S -c BOOT``, its
settings in the environment variable ``SBX_SPAWNER``: a command between its fork and
its exec shows the spawner's command line to the sandbox, which should learn nothing
from it), owns one end of a socketpair and nothing else: no name in any filesystem or
abstract namespace, never inherited by what it starts (every child closes every
descriptor it does not need before it does anything else, so a child that a sandbox
stops before its exec holds only its own pipes). It dies with the executor
(``PR_SET_PDEATHSIG``, and when its socket ends); what it started dies with it
(``enter.py``).

The protocol: frames of a 4-byte length and a ``marshal``-ed dict, both ways (the peer
is the executor, which made the socketpair; JSON would import ``re`` and grow every fork). A ``spawn``
request carries the command's stdin, stdout and stderr as SCM_RIGHTS descriptors and is
answered with its pid or an error; its exit status follows when it ends; ``kill``
signals the process group of a command it started and has not reaped yet (so never a
reused pid). Every field is checked and bounded before anything runs: a request that
names no seccomp filter, a cgroup outside the cgroup root, a capability the sandbox
may not keep or a process that is not a sandbox's init is refused. A start not
answered within its deadline (a child the sandbox stopped before its exec) is killed
and answered ``ETIMEDOUT``; a request that cannot be served (its descriptors did not
fit, an unexpected error) is answered with an error, and the spawner goes on serving
the others.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import marshal
import os
import select
import signal
import socket
import struct
import time

from shared.runtime.local import enter

TYPE_CHECKING = False  # (typing itself is not imported: it would grow every fork)
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

HEADER = struct.Struct("!I")
MAX_FRAME = 8 * 1024 * 1024
"""A request's size at most (a command line and environment: Linux takes 2 MiB of both)."""
STDIO = 3
MAX_ARGS = 65536
MAX_NOFILE = 1 << 20
MAX_BPF = 4096 * 8
"""The kernel's limit on a seccomp program: 4096 instructions of 8 bytes."""
CLOSE_RANGE_CLOEXEC = 4
START_DEADLINE = 15.0
"""Seconds a start may take from fork to exec (milliseconds when nothing is wrong)."""
SETTINGS = "SBX_SPAWNER"
"""The environment variable with the spawner's settings, one per line: the executor's
pid, the socket's descriptor, the cgroup root, the capabilities a command may keep
(comma-separated), the start deadline and, last, the checkout that holds this package."""
BOOT = (
    f"import os,sys;s=os.environ.pop({SETTINGS!r}).split(chr(10));sys.path.insert(0,s[-1]);"
    "from shared.runtime.local import spawnd;spawnd.main(s[:-1])"
)
"""The spawner's program, run with ``python -I -S -c``."""
RESET_SIGNALS = (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGCHLD, signal.SIGINT, signal.SIGTERM)
"""Dispositions this process changed (Python ignores SIGPIPE and SIGXFSZ): a command
starts with the defaults, as it would from ``subprocess``."""


class Refused(Exception):
    """A request that does not pass the checks (nothing was started)."""


def encode(message: dict[str, Any]) -> bytes:
    body = marshal.dumps(message)
    return HEADER.pack(len(body)) + body


def decode_frames(buffer: bytearray) -> list[dict[str, Any]]:
    """The whole frames at the start of ``buffer`` (taken out of it); ValueError for a
    frame over the bound or that is not a dict."""
    messages = []
    while len(buffer) >= HEADER.size:
        (size,) = HEADER.unpack_from(buffer)
        if size > MAX_FRAME:
            raise ValueError(f"a frame of {size} bytes (at most {MAX_FRAME})")
        if len(buffer) < HEADER.size + size:
            break
        try:
            # Written only by marshal.dumps in the executor, which made the socketpair;
            # what a tenant chose is inside as length-framed values, never as structure.
            message = marshal.loads(bytes(buffer[HEADER.size : HEADER.size + size]))  # noqa: S302
        except (EOFError, TypeError) as exc:
            raise ValueError(f"a frame that does not decode: {exc}") from None
        del buffer[: HEADER.size + size]
        if not isinstance(message, dict):
            raise ValueError("a frame that is not a dict")
        messages.append(message)
    return messages


# ---- checks --------------------------------------------------------------------------


def _int(request: dict[str, Any], key: str, low: int, high: int) -> int:
    value = request.get(key)
    if type(value) is not int or not low <= value <= high:
        raise Refused(f"{key} must be an integer in [{low}, {high}]")
    return value


def _strings(request: dict[str, Any], key: str, low: int, high: int) -> list[str]:
    value = request.get(key)
    if not isinstance(value, list) or not low <= len(value) <= high:
        raise Refused(f"{key} must be a list of {low} to {high} strings")
    if not all(isinstance(v, str) and "\0" not in v for v in value):
        raise Refused(f"{key} must hold strings without NUL")
    return value


def _cgroup_files(request: dict[str, Any], cgroup_root: str) -> list[str]:
    paths = _strings(request, "cgroups", 1, 8)
    for path in paths:
        if (
            os.path.normpath(path) != path
            or not path.startswith(cgroup_root + "/")
            or os.path.basename(path) != "cgroup.procs"
        ):
            raise Refused(f"cgroup file {path!r} is not a cgroup.procs under {cgroup_root}")
    return paths


def _bpf(request: dict[str, Any]) -> bytes:
    program = request.get("bpf")
    if not isinstance(program, bytes) or not program or len(program) % 8 or len(program) > MAX_BPF:
        raise Refused("a command enters only under a seccomp filter (bpf: 1 to 4096 instructions)")
    return program


class Command:
    """A checked ``spawn`` request: what to run and where to enter."""

    def __init__(self, request: dict[str, Any], cgroup_root: str, allowed_caps: frozenset[int]) -> None:
        self.argv = _strings(request, "argv", 1, MAX_ARGS)
        self.env = _strings(request, "env", 0, MAX_ARGS)
        if not all("=" in pair for pair in self.env):
            raise Refused("env must hold NAME=value pairs")
        self.path = _strings(request, "path", 0, 256)
        self.cgroups = _cgroup_files(request, cgroup_root)
        caps = request.get("caps")
        if (
            not isinstance(caps, list)
            or not all(type(c) is int for c in caps)
            or not set(caps) <= allowed_caps
        ):
            raise Refused(f"caps must be a subset of {sorted(allowed_caps)}")
        self.entry = enter.Entry(
            pid=_int(request, "pid", 2, (1 << 22)),
            starttime=_int(request, "starttime", 0, (1 << 63) - 1),
            uid=_int(request, "uid", 0, (1 << 32) - 2),
            keep_caps=frozenset(caps),
            nofile=_int(request, "nofile", 1, MAX_NOFILE),
            bpf=_bpf(request),
        )

    def join_cgroups(self) -> None:
        mine = str(os.getpid()).encode()
        for path in self.cgroups:
            fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            try:
                os.write(fd, mine)
            finally:
                os.close(fd)

    def programs(self) -> list[bytes]:
        """Where ``argv[0]`` may be, tried in order, as ``execvpe`` would."""
        name = os.fsencode(self.argv[0])
        if b"/" in name:
            return [name]
        return [os.path.join(os.fsencode(d or "."), name) for d in self.path]


# ---- the child -----------------------------------------------------------------------


def _child(command: Command, enter_sandbox: Callable[[], None], stdio: list[int], report: int) -> None:
    """In the forked child: become the command (never returns). A failure is written to
    ``report`` (close-on-exec: the spawner reads end-of-file when the exec succeeded)."""
    try:
        signal.set_wakeup_fd(-1)
        for sig in RESET_SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        for target, fd in enumerate(stdio):
            os.dup2(fd, target)
        # Before anything a sandbox could stop: the spawner's socket, its other children's
        # report pipes and other requests' pipes stay with the spawner alone.
        _close_all_but(report)
        os.setsid()
        enter_sandbox()  # the first child stays in there: only the command returns
        if enter._libc.syscall(enter.SYS_CLOSE_RANGE, STDIO, 0xFFFFFFFF, CLOSE_RANGE_CLOEXEC) != 0:
            for fd in range(STDIO, 65536):
                if fd != report:
                    with contextlib.suppress(OSError):
                        os.set_inheritable(fd, False)
        env = dict(os.fsencode(pair).split(b"=", 1) for pair in command.env)
        argv = [os.fsencode(a) for a in command.argv]
        saved: OSError | None = None  # as execvpe: the first error other than "not there"
        last: OSError | None = None
        for program in command.programs():
            try:
                os.execve(program, argv, env)  # noqa: S606 - a command line, no shell
            except OSError as exc:
                last = exc
                if saved is None and exc.errno not in (errno.ENOENT, errno.ENOTDIR):
                    saved = exc
        code = (saved or last or FileNotFoundError(errno.ENOENT, "")).errno or errno.ENOENT
        raise OSError(code, os.strerror(code), command.argv[0])
    except BaseException as exc:  # everything is reported, then the child ends
        code = exc.errno if isinstance(exc, OSError) and exc.errno else errno.EINVAL
        with contextlib.suppress(OSError):
            os.write(report, marshal.dumps({"errno": code, "error": str(exc)[:1000]}))
    finally:
        os._exit(255)


def _close_all_but(keep: int) -> None:
    """Close every descriptor from 3 up but ``keep`` (which is above 2)."""
    for low, high in ((STDIO, keep - 1), (keep + 1, 0xFFFFFFFF)):
        if low <= high and enter._libc.syscall(enter.SYS_CLOSE_RANGE, low, high, 0) != 0:
            os.closerange(low, min(high + 1, 65536))


# ---- the server ----------------------------------------------------------------------


class Spawner:
    """The serving loop: requests from the socket, children's ends from SIGCHLD."""

    def __init__(
        self, sock: socket.socket, cgroup_root: str, allowed_caps: frozenset[int], deadline: float
    ) -> None:
        self.sock = sock
        self.cgroup_root = cgroup_root
        self.allowed_caps = allowed_caps
        self.deadline = deadline
        self.buffer = bytearray()
        self.fds: collections.deque[int] = collections.deque()
        self.children: dict[int, int] = {}
        """pid → request id, from fork until reaped."""
        self.starting: dict[int, tuple[int, int, bytearray]] = {}
        """report pipe → (request id, pid, what the child wrote): not answered yet."""
        self.due: dict[int, float] = {}
        """report pipe → when its start is over the deadline (``time.monotonic``)."""
        self.held: dict[int, int] = {}
        """pid → wait status of a child that ended before its start was answered."""
        self.poll = select.poll()
        self.wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.poll.register(sock.fileno(), select.POLLIN)
        self.poll.register(self.wake_r, select.POLLIN)

    def send(self, message: dict[str, Any]) -> None:
        self.sock.sendall(encode(message))

    def serve(self) -> None:
        while True:
            wait = None
            if self.due:
                wait = max(0, int((min(self.due.values()) - time.monotonic()) * 1000) + 1)
            ready = self.poll.poll(wait)
            expired = self.expire()
            for fd, _ in ready:
                if fd in expired:
                    continue
                if fd == self.sock.fileno():
                    if not self.receive():
                        return  # the executor is gone
                elif fd == self.wake_r:
                    with contextlib.suppress(BlockingIOError):
                        while os.read(self.wake_r, 4096):
                            pass
                    self.reap()
                else:
                    self.report(fd)

    def receive(self) -> bool:
        data, ancillary, flags, _ = self.sock.recvmsg(
            1 << 16, socket.CMSG_SPACE(4 * 64), socket.MSG_CMSG_CLOEXEC
        )
        received: list[int] = []
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                usable = len(payload) - len(payload) % 4
                received.extend(struct.unpack(f"{usable // 4}i", payload[:usable]))
        if flags & socket.MSG_CTRUNC:
            # Out of descriptors: one read carries one request's three (the kernel ends a
            # read where another sender's descriptors begin); that request is refused.
            for fd in received:
                os.close(fd)
            received = [-1] * STDIO
        self.fds.extend(received)
        if not data:
            return False
        self.buffer += data
        for message in decode_frames(self.buffer):
            self.handle(message)
        return True

    def handle(self, message: dict[str, Any]) -> None:
        ident = message.get("id")
        if type(ident) is not int:
            raise SystemExit("a request without an id")
        if message.get("op") == "kill":
            self.kill(ident, message.get("signal"))
            return
        if message.get("op") != "spawn":
            self.send({"id": ident, "errno": errno.EINVAL, "error": "unknown request"})
            return
        if len(self.fds) < STDIO:
            raise SystemExit("a spawn request without its three descriptors")
        stdio = [self.fds.popleft() for _ in range(STDIO)]
        try:
            if -1 in stdio:
                raise OSError(errno.EMFILE, "the spawner is out of descriptors; the command did not start")
            self.spawn(ident, Command(message, self.cgroup_root, self.allowed_caps), stdio)
        except Refused as exc:
            self.send({"id": ident, "errno": errno.EINVAL, "error": f"refused: {exc}"})
        except OSError as exc:
            self.send({"id": ident, "errno": exc.errno or errno.EIO, "error": str(exc)})
        except Exception as exc:  # one request's failure, never the spawner's
            self.send({"id": ident, "errno": errno.EIO, "error": f"the spawner failed: {exc!r}"[:1000]})
        finally:
            for fd in stdio:
                if fd >= 0:
                    os.close(fd)

    def spawn(self, ident: int, command: Command, stdio: list[int]) -> None:
        enter_sandbox = enter.prepare(command.entry, command.join_cgroups)  # here: it notes its parent
        report_r, report_w = os.pipe2(os.O_CLOEXEC)
        try:
            pid = os.fork()
        except OSError:
            os.close(report_r)
            os.close(report_w)
            raise
        if pid == 0:
            os.close(report_r)
            _child(command, enter_sandbox, stdio, report_w)
        os.close(report_w)
        self.children[pid] = ident
        self.starting[report_r] = (ident, pid, bytearray())
        self.due[report_r] = time.monotonic() + self.deadline
        self.poll.register(report_r, select.POLLIN)

    def expire(self) -> set[int]:
        """Kill and answer the starts over their deadline (stopped before their exec);
        their report pipes (closed now)."""
        now = time.monotonic()
        expired = {fd for fd, due in self.due.items() if due <= now}
        for fd in expired:
            ident, pid, _ = self.forget(fd)
            if pid not in self.held:  # (not reaped: the group's leader is ours)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
            self.held.pop(pid, None)
            self.children.pop(pid, None)  # its end is nobody's: the start failed
            self.send({
                "id": ident, "errno": errno.ETIMEDOUT,
                "error": f"the command did not start within {self.deadline:g} s; it was killed",
            })  # fmt: skip
        return expired

    def forget(self, fd: int) -> tuple[int, int, bytearray]:
        """Stop following a start's report pipe: what it was."""
        self.poll.unregister(fd)
        os.close(fd)
        self.due.pop(fd, None)
        return self.starting.pop(fd)

    def report(self, fd: int) -> None:
        ident, pid, said = self.starting[fd]
        chunk = os.read(fd, 4096)
        if chunk and len(said) < 8192:
            said += chunk
            return
        if chunk:
            return
        self.forget(fd)
        if said:
            self.children.pop(pid, None)
            self.held.pop(pid, None)
            try:
                failure = marshal.loads(bytes(said))  # noqa: S302 - written by our child before exec
                self.send({"id": ident, "errno": int(failure["errno"]), "error": str(failure["error"])})
            except (ValueError, EOFError, KeyError, TypeError):
                self.send({"id": ident, "errno": errno.EIO, "error": "the command could not start"})
            return
        self.send({"id": ident, "pid": pid})
        if pid in self.held:
            self.send({"id": ident, "status": self.held.pop(pid)})
            self.children.pop(pid, None)

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if any(p == pid for _, p, _ in self.starting.values()):
                self.held[pid] = status
            elif pid in self.children:
                self.send({"id": self.children.pop(pid), "status": status})

    def kill(self, ident: int, sig: object) -> None:
        if type(sig) is not int or sig not in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT):
            return
        for pid, owner in self.children.items():
            if owner == ident and pid not in self.held:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, sig)  # not reaped yet: the group's leader is ours, never a reused pid


def settings(parent: int, fd: int, cgroup_root: str, caps: frozenset[int], deadline: float) -> str:
    """The value of ``SETTINGS`` for a spawner (see there); ValueError for a path that
    cannot be said on one line."""
    checkout = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    if "\n" in cgroup_root or "\n" in checkout:
        raise ValueError("a path with a line break")
    fields = [str(parent), str(fd), cgroup_root, ",".join(map(str, sorted(caps))), str(deadline), checkout]
    return "\n".join(fields)


def main(fields: list[str]) -> None:
    parent, fd, cgroup_root, caps = int(fields[0]), int(fields[1]), fields[2], fields[3]
    deadline = float(fields[4])
    enter._libc.prctl(enter.PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # it died before the line above
        os._exit(1)
    sock = socket.socket(fileno=fd)
    sock.set_inheritable(False)
    allowed = frozenset(int(c) for c in caps.split(",") if c)
    Spawner(sock, os.path.normpath(cgroup_root), allowed, deadline).serve()
    os._exit(0)
