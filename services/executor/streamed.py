"""The host API's streamed operations in a sandbox: a one-off command with live output,
an upload (deletions, then a tar extracted), a download (a tar of named paths), and the
listing of a tree that lets the client see what a command changed.

Each operation starts before the executor replies (so a sandbox that is gone or not
running is an ordinary error reply), then runs in a task of its own that streams its
result to the caller's inbox (:mod:`shared.infrastructure.streams`) and ends with a
:class:`sbx_api.hostapi.End` frame. A message on the request's ``stop`` subject, a
caller that goes away or stops acknowledging, or the executor's drain kills what runs
in the sandbox: nothing keeps running for nobody.

Everything the sandbox sends back (output, tar bytes, listings) is passed through
untouched, never parsed here; the client treats it as untrusted. What the sandbox's own
programs (which root inside can replace) write is bounded: streams go out no faster than
the caller takes them (:mod:`shared.infrastructure.streams`), a listing stops at
:data:`~sbx_api.hostapi.LISTING_MAX`, and what goes to no channel (messages, an
upload's stdout) stops at :data:`UNASKED_MAX`; past a bound the process is killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Awaitable, Callable

import msgspec
import structlog
from nats.aio.client import Client

from sbx_api import errors, hostapi
from services.executor import output, scripts, watch
from shared.contract import checks, execution
from shared.infrastructure import streams
from shared.runtime import api

log = structlog.get_logger(__name__)

TRANSFER_TIMEOUT = 120.0
"""Longest an upload, a download or a listing may take in the sandbox."""
MESSAGE_MAX = 4096
UNASKED_MAX = 16 * 1024 * 1024
"""Most bytes a process may write that go to no channel (its messages, an upload's
stdout; the first and last ``MESSAGE_MAX / 2`` are kept): past it, it is killed."""
LINGER = 0.5
"""After a command ends, how long its output may still come from what it left running."""
_STREAM = {"stdout": hostapi.STDOUT, "stderr": hostapi.STDERR}

#: Removes the NUL-separated relative paths read from stdin (operands, after ``--``).
DELETE = 'cd -- "$1" || exit 0; exec xargs -0 -r rm -rf --'
#: Extracts a tar from stdin into $1 (created if missing), keeping modes and mtimes.
#: Extracts a tar from stdin into $1 (created if missing), keeping modes and mtimes, then
#: runs the rest of the arguments (the listing) in the same process: one exec, not two.
#: Exit 3: the tar failed (fatal); else the listing's status.
EXTRACT = (
    'mkdir -p -- "$1" && cd -- "$1" || exit 3; shift; '
    'tar -x -p -f - --no-same-owner || { echo "tar failed ($?)" >&2; exit 3; }; '
    '[ $# -eq 0 ] || exec "$@"'
)
#: A tar of the NUL-separated relative paths read from stdin, directories without children.
ARCHIVE = 'cd -- "$1" || exit 3; exec tar -c -f - --null --no-recursion -T -'
ARCHIVE_RECURSIVE = 'cd -- "$1" || exit 3; exec tar -c -f - --null -T -'
#: The bytes of the file $1 (any absolute path in the sandbox). Exit 44: no such file;
#: 46: a directory (the codes of :mod:`services.executor.files`).
READ_FILE = '[ -e "$1" ] || exit 44; [ -d "$1" ] && exit 46; exec cat -- "$1"'
#: Writes stdin to the file $1, its parent directories made. Exit 46: $1 is a directory.
WRITE_FILE = '[ -d "$1" ] && exit 46; mkdir -p -- "$(dirname -- "$1")" || exit 3; exec cat > "$1"'

Finished = Callable[[execution.Streamed, hostapi.End, float, str | None], Awaitable[None]]


def listing_argv(prune: list[str]) -> list[str]:
    """``find`` over the current directory, skipping directories named in ``prune``."""
    argv = ["find", ".", "-mindepth", "1"]
    if prune:
        names: list[str] = []
        for name in prune:
            names += [*(["-o"] if names else []), "-name", name]
        argv += ["(", "-type", "d", "(", *names, ")", ")", "-prune", "-o"]
    return [*argv, "-printf", hostapi.LIST_FORMAT]  # find turns \\0 into NUL itself


def put_listing_argv(request: execution.PutFiles) -> list[str]:
    """What lists the tree after an upload: all of it, only the named paths, or nothing."""
    if not request.listing:
        return []
    if request.list_paths is None:
        return listing_argv(request.prune)
    # Only these paths (each given as a starting point, listed as given: %p, not %P).
    return ["find", *request.list_paths, "-maxdepth", "0", "-printf", hostapi.LIST_FORMAT.replace("%P", "%p")]


def run_argv(request: execution.Run) -> list[str]:
    unset: list[str] = []
    for name in request.unset:
        unset += ["-u", name]
    return ["env", *unset, "bash", "-c", request.command] if unset else ["bash", "-c", request.command]


def validate(request: execution.Streamed) -> None:
    """Bad input is refused before anything runs (pure)."""
    match request:
        case execution.Run():
            checks.run(request)
        case execution.PutFiles():
            hostapi.validate_root(request.root)
            if len(request.delete) > hostapi.MAX_DELETES:
                raise errors.InvalidInput(f"at most {hostapi.MAX_DELETES} deletions per upload")
            for path in request.delete:
                hostapi.validate_relative(path)
            hostapi.validate_prune(request.prune)
            if request.list_paths is not None:
                if len(request.list_paths) > hostapi.MAX_LIST_PATHS:
                    raise errors.InvalidInput(f"at most {hostapi.MAX_LIST_PATHS} paths to list")
                for path in request.list_paths:
                    if hostapi.validate_relative(path).startswith(("-", "!", "(", ")")):
                        raise errors.InvalidInput(f"a path to list cannot start with {path[0]!r}")
        case execution.GetFiles():
            hostapi.validate_root(request.root)
        case execution.ReadFile() | execution.WriteFile() | execution.WatchDir():
            checks.path(request.path)
        case execution.ShellFollow():
            checks.job_id(request.job_id)


class StreamedOps:
    def __init__(self, runtime: api.Runtime, nc: Client, finished: Finished) -> None:
        self.runtime = runtime
        self.nc = nc
        self.finished = finished
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self, request: execution.Streamed) -> execution.Reply:
        validate(request)
        inputs = None
        match request:
            case execution.Run():
                process = await self.runtime.exec(
                    request.sandbox_id,
                    run_argv(request),
                    env=request.env,
                    cwd=request.cwd,
                    timeout=request.timeout or execution.DEFAULT_TIMEOUT,
                )
                work = functools.partial(self._run, request, process)
            case execution.PutFiles():
                await self._delete(request)
                process = await self.runtime.exec(
                    request.sandbox_id,
                    ["/bin/sh", "-c", EXTRACT, "sbx", request.root, *put_listing_argv(request)],
                    timeout=TRANSFER_TIMEOUT,
                    keep_stdin_open=True,
                )
                inputs = await self.nc.subscribe(self.nc.new_inbox())
                work = functools.partial(self._put, request, process, inputs)
            case execution.GetFiles():
                script = ARCHIVE_RECURSIVE if request.recursive else ARCHIVE
                process = await self._script(request, script, request.root)
                inputs = await self.nc.subscribe(self.nc.new_inbox())
                work = functools.partial(self._get, request, process, inputs)
            case execution.ReadFile():
                process = await self.runtime.exec(
                    request.sandbox_id,
                    ["/bin/sh", "-c", READ_FILE, "sbx", request.path],
                    timeout=TRANSFER_TIMEOUT,
                )
                work = functools.partial(self._read_file, request, process)
            case execution.ShellFollow():
                process = await self.runtime.exec(
                    request.sandbox_id,
                    scripts.argv(
                        scripts.JOB_FOLLOW, request.job_id, "start" if request.from_start else "now"
                    ),
                )  # no timeout: it ends with the job, or when the caller goes away or stops it
                work = functools.partial(self._follow, request, process)
            case execution.WatchDir():
                process = await self.runtime.exec(
                    request.sandbox_id,
                    scripts.argv(
                        watch.STREAM,
                        request.path,
                        watch.depth(request.recursive),
                        watch.RECORD,
                        watch.INTERVAL,
                    ),
                )  # no timeout: it ends when the caller goes away or stops it, or the directory goes
                work = functools.partial(self._watch, request, process)
            case execution.WriteFile():
                process = await self._script(request, WRITE_FILE, request.path)
                inputs = await self.nc.subscribe(self.nc.new_inbox())
                work = functools.partial(self._write_file, request, process, inputs)
            case _:
                raise errors.InvalidInput(f"{type(request).__name__} is not a streamed operation")
        stopped = asyncio.Event()

        async def on_stop(_: object) -> None:
            stopped.set()
            with contextlib.suppress(Exception):
                await process.kill()  # the work then ends as usual, with the killed exit status

        # Subscribed before the reply leaves, so no input frame and no stop is missed: the
        # flush waits until the server has these subscriptions. (Without it, a caller could
        # send its first input frame before the subscription existed there: the frame was
        # lost and the upload given up 30 s later, under load.)
        stop = await self.nc.subscribe(request.stop, cb=on_stop, max_msgs=1)
        try:
            await self.nc.flush(timeout=10)
        except Exception as exc:
            for sub in (stop, inputs):
                if sub is not None:
                    with contextlib.suppress(Exception):
                        await sub.unsubscribe()
            with contextlib.suppress(Exception):
                await process.kill()
            raise errors.Unavailable(f"NATS did not confirm the operation's subscriptions: {exc}") from None
        task = asyncio.create_task(self._guard(request, process, work, stop, inputs, stopped))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return execution.Reply(ok=True, input=inputs.subject if inputs is not None else None)

    async def _delete(self, request: execution.PutFiles) -> None:
        if not request.delete:
            return
        names = b"".join(path.encode(errors="surrogateescape") + b"\0" for path in request.delete)
        result, out, err = await self.runtime.run(
            request.sandbox_id,
            ["/bin/sh", "-c", DELETE, "sbx", request.root],
            stdin=names,
            timeout=TRANSFER_TIMEOUT,
        )
        if result.exit_code != 0:
            raise errors.InvalidInput(
                f"could not delete under {request.root}: {output.text(out + err).strip()[:MESSAGE_MAX]}"
            )

    async def _script(self, request: execution.Streamed, script: str, root: str) -> api.Exec:
        return await self.runtime.exec(
            request.sandbox_id,
            ["/bin/sh", "-c", script, "sbx", root],
            timeout=TRANSFER_TIMEOUT,
            keep_stdin_open=True,
        )

    async def _guard(self, request, process, work, stop, inputs, stopped) -> None:
        """Run ``work(sender)``; if the caller goes away, the work fails or the executor
        drains, kill the process. Failures reach the caller as an error frame."""
        started = time.monotonic()
        end, failure = hostapi.End(), None
        try:
            async with streams.Sender(self.nc, request.inbox) as sender:
                try:
                    end = await work(sender)
                    if stopped.is_set():
                        failure = "stopped by the caller"
                except errors.SandboxError as exc:
                    failure = exc.message
                    with contextlib.suppress(streams.Aborted):
                        await sender.error(exc)
                except streams.Aborted:
                    raise
                except Exception as exc:
                    log.exception("executor.streamed_crashed", op=type(request).__name__)
                    failure = f"internal error: {type(exc).__name__}"
                    with contextlib.suppress(streams.Aborted):
                        await sender.error(errors.InfrastructureError(failure))
        except streams.Aborted as exc:
            failure = f"the caller went away: {exc}"
        except asyncio.CancelledError:
            failure = "the executor is shutting down"
            raise
        finally:
            if failure is not None:
                with contextlib.suppress(Exception):
                    await process.kill()
            for sub in (stop, inputs):
                if sub is not None:
                    with contextlib.suppress(Exception):
                        await sub.unsubscribe()
            with contextlib.suppress(Exception):
                await self.finished(request, end, time.monotonic() - started, failure)

    async def _pump(self, process: api.Exec, sender: streams.Sender, channels: dict[str, bytes]) -> bytes:
        """Send the process's output on ``channels``; keep what goes to no channel (its
        ends). Past a bound (a listing's, or :data:`UNASKED_MAX` of the rest) the process
        is killed and LimitExceeded raised; nothing beyond the bound is sent."""
        kept = output.Capture(MESSAGE_MAX)
        listed = 0
        async for stream, data in process.chunks():
            channel = channels.get(stream)
            if channel is None:
                kept.add(data)
                if kept.total > UNASKED_MAX:
                    await _kill(process)
                    raise errors.LimitExceeded(
                        f"a program in the sandbox wrote more than {UNASKED_MAX} bytes that were not "
                        "asked for (messages, or output where none is expected); it was killed"
                    )
                continue
            if channel == hostapi.LISTING:
                listed += len(data)
                if listed > hostapi.LISTING_MAX:
                    await _kill(process)
                    raise errors.LimitExceeded(
                        f"the listing is larger than {hostapi.LISTING_MAX} bytes; what wrote it was killed"
                    )
            await sender.send(channel, data)
        return bytes(kept.head + kept.tail)

    @staticmethod
    async def _beat(sender: streams.Sender, process: api.Exec) -> None:
        """Heartbeats while the process runs; a caller that is gone kills it (the next
        frame then fails the operation)."""
        try:
            await sender.heartbeats()
        except streams.Aborted:
            with contextlib.suppress(Exception):
                await process.kill()

    async def _listing(self, request: execution.Streamed, root: str, prune: list[str], sender) -> str:
        """Stream ``root``'s listing; return a complaint if it is incomplete, else ''."""
        process = await self.runtime.exec(
            request.sandbox_id, listing_argv(prune), cwd=root, timeout=TRANSFER_TIMEOUT
        )
        try:
            complaint = await self._pump(process, sender, {"stdout": hostapi.LISTING})
        except errors.LimitExceeded as exc:
            await process.wait()
            return f"the listing of {root} is incomplete: {exc.message}"
        result = await process.wait()
        if result.exit_code != 0:
            why = output.text(complaint).strip()[:MESSAGE_MAX] or f"exit status {result.exit_code}"
            return f"the listing of {root} is incomplete: {why}"
        return ""

    async def _run(self, request: execution.Run, process: api.Exec, sender: streams.Sender) -> hostapi.End:
        beats = asyncio.create_task(self._beat(sender, process))
        pump = asyncio.create_task(self._pump(process, sender, _STREAM))
        exited = asyncio.create_task(process.exited())
        left_running = False
        try:
            await asyncio.wait({pump, exited}, return_when=asyncio.FIRST_COMPLETED)
            if not pump.done():
                # The command ended; what it left running (a daemon, `cmd &`) may hold its
                # output open for ever. Its last words get a moment, then it is let go.
                done, _ = await asyncio.wait({pump}, timeout=LINGER)
                if not done:
                    left_running = True
                    pump.cancel()
                    process.detach()
            if not left_running:
                await pump
            result = await exited if left_running else await process.wait()
        finally:
            beats.cancel()
            pump.cancel()
            exited.cancel()
        message = (
            "processes the command left running still hold its output: it is not shown"
            if left_running
            else ""
        )
        listing_error = ""
        if request.list_root is not None:
            listing_error = await self._listing(request, request.list_root, request.prune, sender)
        end = hostapi.End(
            exit_code=None if result.timed_out else result.exit_code,
            timed_out=result.timed_out,
            duration=result.duration,
            sandbox_id=request.sandbox_id,
            message=message,
            listing_error=listing_error,
        )
        await sender.end(msgspec.json.encode(end))
        return end

    async def _feed(self, inputs, process: api.Exec) -> None:
        """Copy the caller's input stream into the process's stdin, acknowledging each
        frame once the process took it."""
        seq = 0
        while True:
            try:
                msg = await inputs.next_msg(timeout=streams.SILENCE)
            except TimeoutError:
                raise errors.Unavailable("the caller stopped sending its input") from None
            headers = msg.headers or {}
            seq += 1
            if headers.get("Sbx-Seq") != str(seq):
                raise errors.InvalidInput("an input frame was lost")
            channel = headers.get("Sbx-Ch", "").encode()
            if channel == streams.END:
                await process.close_stdin()
                await msg.respond(b"")
                return
            if channel != streams.PING:
                try:
                    await process.send(msg.data)
                except errors.SandboxError:
                    await msg.respond(streams.STOP)  # the process stopped reading: say so
                    await process.close_stdin()
                    return
            await msg.respond(b"")

    async def _put(self, request: execution.PutFiles, process: api.Exec, inputs, sender) -> hostapi.End:
        beats = asyncio.create_task(self._beat(sender, process))
        # Without a listing, stdout is nothing anyone asked for (tar -x writes none).
        channels = {"stdout": hostapi.LISTING} if request.listing else {}
        pump = asyncio.create_task(self._pump(process, sender, channels))
        feed = asyncio.create_task(self._feed(inputs, process))
        try:
            # A pump that fails (a bound passed: the process is killed) ends the upload now.
            await asyncio.wait({pump, feed}, return_when=asyncio.FIRST_COMPLETED)
            if pump.done():
                pump.result()
            await feed
            complaint = await pump
            result = await process.wait()
        finally:
            for task in (beats, pump, feed):
                task.cancel()
        why = output.text(complaint).strip()[:MESSAGE_MAX]
        message = listing_error = ""
        exit_code = result.exit_code
        if result.exit_code == 3 or result.timed_out or (result.exit_code != 0 and not request.listing):
            message = f"extracting failed: {why or ('timed out' if result.timed_out else exit_code)}"
        elif result.exit_code != 0 and request.list_paths is None:
            listing_error = f"the listing of {request.root} is incomplete: {why or result.exit_code}"
            exit_code = 0
        else:
            exit_code = 0  # a path listed by name may be gone (deleted): that is an answer too
        end = hostapi.End(
            exit_code=exit_code,
            duration=result.duration,
            sandbox_id=request.sandbox_id,
            message=message,
            listing_error=listing_error,
        )
        await sender.end(msgspec.json.encode(end))
        return end

    async def _get(self, request: execution.GetFiles, process: api.Exec, inputs, sender) -> hostapi.End:
        feed = asyncio.create_task(self._feed(inputs, process))
        try:
            complaint = await self._pump(process, sender, {"stdout": hostapi.TAR})
            await feed
        finally:
            feed.cancel()
        result = await process.wait()
        message = output.text(complaint).strip()[:MESSAGE_MAX] if result.exit_code != 0 else ""
        end = hostapi.End(
            exit_code=result.exit_code,
            duration=result.duration,
            sandbox_id=request.sandbox_id,
            message=message,
        )
        await sender.end(msgspec.json.encode(end))
        return end

    async def _read_file(self, request: execution.ReadFile, process: api.Exec, sender) -> hostapi.End:
        beats = asyncio.create_task(self._beat(sender, process))
        try:
            complaint = await self._pump(process, sender, {"stdout": hostapi.STDOUT})
        finally:
            beats.cancel()
        return await self._ended(request, process, sender, complaint)

    async def _write_file(
        self, request: execution.WriteFile, process: api.Exec, inputs, sender
    ) -> hostapi.End:
        beats = asyncio.create_task(self._beat(sender, process))
        pump = asyncio.create_task(self._pump(process, sender, {}))  # cat writes nothing asked for
        feed = asyncio.create_task(self._feed(inputs, process))
        try:
            await asyncio.wait({pump, feed}, return_when=asyncio.FIRST_COMPLETED)
            if pump.done():
                pump.result()
            await feed
            complaint = await pump
        finally:
            for task in (beats, pump, feed):
                task.cancel()
        return await self._ended(request, process, sender, complaint)

    async def _follow(self, request: execution.ShellFollow, process: api.Exec, sender) -> hostapi.End:
        beats = asyncio.create_task(self._beat(sender, process))
        try:
            await self._pump(process, sender, _STREAM)
        finally:
            beats.cancel()
        result = await process.wait()
        status, code = "exited", result.exit_code
        code_known: int | None = code
        if result.timed_out or code is None or not 0 <= code < scripts.FOLLOW_ASK:
            # Not a plain exit (stopped, lost, no such job), or the follow itself was stopped:
            # how the job stands, from its files.
            _, out, _ = await self.runtime.run(
                request.sandbox_id,
                scripts.argv(scripts.JOB_POLL, request.job_id, "0"),
                timeout=scripts.QUICK,
                max_bytes=MESSAGE_MAX,
            )
            report = scripts.parse_poll(out)
            status, code_known = report.status, report.exit_code
        end = hostapi.End(
            exit_code=code_known, duration=result.duration, sandbox_id=request.sandbox_id, message=status
        )
        await sender.end(msgspec.json.encode(end))
        return end

    async def _watch(self, request: execution.WatchDir, process: api.Exec, sender) -> hostapi.End:
        """Listings as they come, compared with the one before; each batch of changes one
        stdout frame (nothing while nothing changes: heartbeats keep the stream alive),
        the first an empty one once the first listing is taken."""
        beats = asyncio.create_task(self._beat(sender, process))
        encoder = msgspec.json.Encoder()
        pending, before = b"", None
        try:
            async for stream, data in process.chunks():
                if stream != "stdout":
                    continue  # (its messages go to /dev/null; a replaced find's are dropped)
                pending += data
                listings, pending = watch.split(pending)
                if len(pending) > watch.LISTING_BYTES:
                    await _kill(process)
                    raise errors.LimitExceeded(
                        f"a listing of {request.path} is larger than {watch.LISTING_BYTES} bytes: "
                        "watch a smaller directory"
                    )
                for listing in listings:
                    if before is None:  # the first: an empty batch says the watch has begun
                        await sender.send(hostapi.STDOUT, b"[]")
                    elif found := watch.changes(before, listing):
                        await sender.send(hostapi.STDOUT, encoder.encode(found))
                    before = listing
        except errors.SandboxError:
            await _kill(process)
            raise
        finally:
            beats.cancel()
        return await self._ended(request, process, sender, b"")

    @staticmethod
    async def _ended(request: execution.Streamed, process: api.Exec, sender, complaint: bytes) -> hostapi.End:
        result = await process.wait()
        end = hostapi.End(
            exit_code=None if result.timed_out else result.exit_code,
            timed_out=result.timed_out,
            duration=result.duration,
            sandbox_id=request.sandbox_id,
            message=output.text(complaint).strip()[:MESSAGE_MAX] if result.exit_code != 0 else "",
        )
        await sender.end(msgspec.json.encode(end))
        return end

    async def close(self) -> None:
        """Drain: running operations are stopped (their processes killed)."""
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=10)


async def _kill(process: api.Exec) -> None:
    with contextlib.suppress(Exception):
        await process.kill()
