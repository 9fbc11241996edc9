"""Thin glue: an execution request → runtime calls with the scripts → a reply and an audit event."""

from __future__ import annotations

import asyncio
import re
import time

import structlog
from nats.aio.msg import Msg
from nats.js.kv import KeyValue

from sbx_api import errors, hostapi
from services.executor import caches, edits, files, jobs, output, records, scripts, shells, streamed, watch
from shared.contract import checks, codec, commands, events, execution, ids, states, subjects
from shared.domain import audit
from shared.infrastructure import (
    activity,
    auditrate,
    bounded,
    metrics,
    projector,
    responders,
    rpc,
    service,
    tracing,
)
from shared.runtime import api

log = structlog.get_logger(__name__)

_SANDBOX_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
HELPER_SLACK = 64 * 1024
"""Room beyond the data a helper script returns (its status lines): past it, the helper
(whose tools are the sandbox's own, which it may have replaced) is killed."""
OWNERS_REMEMBERED = 10_000


class Executor:
    def __init__(
        self,
        ctx: service.Context,
        runtime: api.Runtime,
        sandboxes: projector.ProjectionStore[states.SandboxState],
        output_limit: int,
        activity_kv: KeyValue | None = None,
        shell_servers: shells.ShellServers | None = None,
        tenant_caches: caches.TenantCaches | None = None,
        audit_rate: auditrate.AuditRate | None = None,
    ) -> None:
        self.ctx = ctx
        self.runtime = runtime
        self.shells = shell_servers or shells.ShellServers(runtime)
        self.sandboxes = sandboxes
        self.limit = output_limit
        self.activity_kv = activity_kv
        self.streamed = streamed.StreamedOps(runtime, ctx.nc, self._streamed_finished)
        self.tenant_caches = tenant_caches
        self.audit_rate = audit_rate
        self._owners: bounded.Bounded[str, str] = bounded.Bounded(OWNERS_REMEMBERED)
        self._calls: dict[str, tuple[str, asyncio.Future[execution.Reply]]] = {}
        """Calls running here that a cancellation may stop: call id → (session token, task)."""
        self._cancelled: set[str] = set()
        self._audit_problem: str | None = None
        """Why the last audit record could not be written, until one can be again: while
        set, a call is run only once a record of its start is written (fails closed)."""

    async def handle(self, raw: bytes) -> bytes:
        started = time.monotonic()
        request: execution.AnyRequest | None = None
        valid = False
        unrecordable = False  # refused before running: nothing to record, nothing that could be
        try:
            request = rpc.decode(rpc.EXEC, raw)
            ids.validate_session_id(request.session_id)
            valid = True
            (sandbox, session), refused = await self._admit(request)
            if refused is not None:
                unrecordable = True  # not recorded: recording refusals would be the flood itself
                metrics.audit_refused.inc()
                raise refused
            if self.tenant_caches is not None:
                await self.tenant_caches.ensure(request, sandbox, session)
            # Busy for as long as the call may run (so the reaper never counts it idle),
            # recorded while the call starts; the end-of-call touch comes after it.
            if self._audit_problem is not None and records.acts(request):
                problem = await self._audit(request, execution.Reply(ok=True), 0.0, outcome="started")
                if problem is not None:
                    unrecordable = True
                    raise errors.InfrastructureError(
                        f"not run: the event store refuses audit records ({problem[:200]}); "
                        "no command runs unrecorded, retry once it accepts them again"
                    )
            busy = asyncio.ensure_future(
                self._touch(request.session_id, busy_for=self._budget(request))
                if records.active(request)
                else asyncio.sleep(0)
            )
            try:
                if isinstance(request, execution.Streamed):
                    # Started, not finished: its end is touched and audited when it ends.
                    return codec.encode(await self.streamed.start(request))
                reply = await self._cancellable(request)
            finally:
                await busy
        except Exception as exc:
            reply = _error_reply(exc, "executor.request_crashed")
        if request is not None:
            tool = events.tag_of(type(request))
            metrics.exec_seconds.labels(tool).observe(time.monotonic() - started)
        if request is not None and valid and not unrecordable:
            # The call ends the busy period (activity) and is audited: both at once.
            _, problem = await asyncio.gather(
                self._touch(request.session_id) if records.active(request) else asyncio.sleep(0),
                self._audit(request, reply, time.monotonic() - started),
            )
            if problem is not None:
                reply = records.unaudited(reply, problem)
        if not reply.ok and reply.error is not None:
            tool = events.tag_of(type(request)) if request is not None else "undecodable"
            metrics.exec_errors.labels(tool, reply.error.code).inc()
        tracing.settle(reply)
        return codec.encode(reply)

    async def _cancellable(self, request: execution.AnyRequest) -> execution.Reply:
        """The request dispatched in a task of its own, which a cancellation stops."""
        if request.call_id is None:
            return await self.dispatch(request)
        task = asyncio.ensure_future(self.dispatch(request))
        self._calls[request.call_id] = (ids.token(request.session_id), task)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.cancelled() or request.call_id not in self._cancelled:
                task.cancel()  # this executor is stopping
                raise
            current = asyncio.current_task()
            if current is not None and current.cancelling():  # also stopping
                raise
            metrics.exec_cancelled.labels(events.tag_of(type(request))).inc()
            raise errors.Cancelled("cancelled by the client; the command was killed") from None
        finally:
            self._calls.pop(request.call_id, None)
            self._cancelled.discard(request.call_id)

    async def cancel(self, msg: Msg) -> None:
        """A gateway's client cancelled a call or went away (``<ns>.exec.cancel.<token>.<call>``):
        the call is stopped if this executor runs it (a shell call's command is killed)."""
        parts = msg.subject.rsplit(".", 2)
        if len(parts) != 3:
            return
        _, token, call_id = parts
        found = self._calls.get(call_id)
        if found is None or found[0] != token:
            return
        log.info("executor.call_cancelled", call_id=call_id)
        self._cancelled.add(call_id)
        found[1].cancel()

    async def prepare(self, raw: bytes) -> bytes:
        """Start the shell relay and bash of an unclaimed pool sandbox (asked by the pool-manager
        before it offers the sandbox); refused for any sandbox a session has."""
        return await rpc.answer(rpc.PREPARE, raw, self._prepare, crashed="executor.prepare_crashed")

    async def _prepare(self, request: execution.Prepare) -> execution.Reply:
        if not _SANDBOX_ID.fullmatch(request.sandbox_id):
            raise errors.InvalidInput("sandbox_id must be 1 to 128 letters, digits, '_', '.', ':', '-'")
        sandbox = await self.sandboxes.get(request.sandbox_id)
        if sandbox is None or sandbox.pool is None or sandbox.status != "running":
            raise errors.NotFound(f"no running pool sandbox {request.sandbox_id!r}")
        if sandbox.session_id is not None:
            raise errors.Conflict(f"sandbox {request.sandbox_id!r} is already claimed")
        started = await self.shells.prepare(request.sandbox_id)
        return execution.Reply(ok=True, status="running" if started else None)

    async def jobs(self, raw: bytes) -> bytes:
        """Which async jobs of a session's sandbox run (asked before an idle pause). Not a
        tool call: neither activity nor audited."""
        return await rpc.answer(rpc.JOBS, raw, self._jobs, crashed="executor.jobs_crashed")

    async def _jobs(self, request: execution.Jobs) -> execution.Reply:
        ids.validate_session_id(request.session_id)
        sandbox = await self.sandboxes.get(request.sandbox_id)
        if sandbox is None or sandbox.session_id != request.session_id:
            raise errors.NotFound(f"session {request.session_id!r} has no sandbox {request.sandbox_id!r}")
        result, out, _ = await self.runtime.run(
            request.sandbox_id, scripts.argv(scripts.JOB_LIST), timeout=scripts.QUICK, max_bytes=HELPER_SLACK
        )
        if result.exit_code != 0:
            raise errors.InfrastructureError(
                f"could not list the sandbox's jobs (exit code {result.exit_code})"
            )
        running = [line for line in output.text(out).split() if re.fullmatch(r"[0-9a-f]{32}", line)]
        return execution.Reply(ok=True, status="running" if running else None, output="\n".join(running))

    @staticmethod
    def _budget(request: execution.AnyRequest) -> float:
        """The longest this request may run (so the reaper never counts it as idle)."""
        match request:
            case execution.Shell():
                return request.timeout or execution.DEFAULT_TIMEOUT
            case execution.ShellWait():
                return request.timeout or 30.0
            case execution.Run():
                return request.timeout or execution.DEFAULT_TIMEOUT
        return scripts.QUICK

    async def _touch(self, session_id: str, *, busy_for: float = 0.0) -> None:
        """Every tool call is activity, polls and waits included (the idle rule's clock)."""
        if self.activity_kv is None:
            return
        try:
            await activity.touch(self.activity_kv, session_id, busy_for=busy_for)
        except errors.SandboxError as exc:
            log.warning("executor.activity_failed", error=exc.message)

    async def _admit(
        self, request: execution.AnyRequest
    ) -> tuple[tuple[states.SandboxState | None, states.SessionState | None], errors.LimitExceeded | None]:
        """The owner check (see ``_lookups``) and the charge of the call's audit record to
        its session's allowance, at once; the refusal, if the allowance is used up. A
        failed owner check wins: it is answered (and recorded) as before."""
        if self.audit_rate is None or not self.audit_rate.on or not records.acts(request):
            return await self._lookups(request), None
        what, path, _ = records.described(request)
        charge = self.audit_rate.charge(request.session_id, audit.cost(what + (path or "")))
        looked, charged = await asyncio.gather(self._lookups(request), charge, return_exceptions=True)
        if isinstance(looked, BaseException):
            raise looked
        if isinstance(charged, errors.LimitExceeded):
            return looked, charged
        if isinstance(charged, BaseException):
            raise charged
        return looked, None

    async def _lookups(
        self, request: execution.AnyRequest
    ) -> tuple[states.SandboxState | None, states.SessionState | None]:
        """The owner check and, when the cache check will need it, the session's record:
        read at once (a session's first call on a sandbox makes both reads)."""
        caches = self.tenant_caches
        if caches is None or not caches.pending(request.sandbox_id):
            return await self._check_owner(request), None
        sandbox, session = await asyncio.gather(
            self._check_owner(request), caches.sessions.get(request.session_id)
        )
        return sandbox, session

    async def _check_owner(self, request: execution.AnyRequest) -> states.SandboxState | None:
        """Defence in depth: the sandbox must belong to the session named in the request.
        A sandbox's session never changes once set (it is never given to another), so an
        owner seen once is remembered; a sandbox deleted since is then refused by the
        runtime (not found) instead, which callers treat alike. Returns the record when it
        read one (None when the owner was remembered)."""
        if self._owners.get(request.sandbox_id) == request.session_id:
            return None
        sandbox = await self.sandboxes.get(request.sandbox_id)
        if sandbox is None or sandbox.session_id != request.session_id or sandbox.status == "deleted":
            raise errors.NotFound(f"session {request.session_id!r} has no sandbox {request.sandbox_id!r}")
        self._owners[request.sandbox_id] = request.session_id
        return sandbox

    async def dispatch(self, request: execution.AnyRequest) -> execution.Reply:
        match request:
            case execution.Shell():
                return await self.shell(request)
            case execution.ShellAsync():
                return await jobs.start(self.runtime, request)
            case execution.ShellInput():
                return await jobs.give_input(self.runtime, request)
            case execution.ShellSignal():
                return await jobs.signal(self.runtime, request)
            case execution.ShellJobs():
                return await jobs.running(self.runtime, request)
            case execution.ShellPoll():
                return await self.poll(request.sandbox_id, checks.job_id(request.job_id))
            case execution.ShellWait():
                return await self.wait(request)
            case execution.ShellStop():
                return await self.stop(request)
            case execution.Edit():
                return await self.edit(request)
            case execution.Files() | execution.Watch() | execution.SandboxUsage():
                return await self.inspect(request)
            case _:  # Run, PutFiles, GetFiles, ReadFile, WriteFile, ShellFollow: ``streamed``
                raise errors.InvalidInput(f"{events.tag_of(type(request))} is a streamed operation")

    async def inspect(
        self, request: execution.Files | execution.Watch | execution.SandboxUsage
    ) -> execution.Reply:
        """The filesystem's operations, its watchers and the sandbox's resource use."""
        match request:
            case execution.Files():
                return await files.run(self.runtime, request)
            case execution.Watch():
                return await watch.run(self.runtime, request)
        return execution.Reply(ok=True, usage=await self.runtime.usage(request.sandbox_id))

    async def stop(self, request: execution.ShellStop) -> execution.Reply:
        job = checks.job_id(request.job_id)
        result, _, _ = await self.runtime.run(
            request.sandbox_id, scripts.argv(scripts.JOB_STOP, job), timeout=scripts.QUICK
        )
        if result.exit_code == 3:
            raise errors.NotFound(f"no job {job} in this session")
        return await self.poll(request.sandbox_id, job)

    # ---- shell ---------------------------------------------------------------------

    @staticmethod
    def _timeout(value: float | None, default: float) -> float:
        checked = checks.timeout(value)
        return default if checked is None else checked

    async def shell(self, request: execution.Shell) -> execution.Reply:
        checks.command(request.command)
        timeout = self._timeout(request.timeout, execution.DEFAULT_TIMEOUT)
        capture = output.Capture(self.limit)
        responders.report_progress(lambda: f"output={capture.total}")  # said by the call's beats
        result: shells.Result | api.ExecResult | None = await self._shell_session(request, capture, timeout)
        if result is None:  # no bash here: sh, with the cwd and exports kept in files
            running = await self.runtime.exec(
                request.sandbox_id,
                ["/bin/sh", "-c", scripts.SHELL, "sbx"],
                stdin=request.command.encode(),
                timeout=timeout,
            )
            async for _, data in running.chunks():
                capture.add(data)
            result = await running.wait()
        text = capture.render()
        if result.timed_out:
            text += f"\n[timed out after {timeout:g} s: the command was killed; use shell_async instead]"
        return execution.Reply(
            ok=True,
            output=text,
            exit_code=None if result.timed_out else result.exit_code,
            timed_out=result.timed_out,
            truncated=capture.truncated,
            duration=result.duration,
        )

    async def _shell_session(
        self, request: execution.Shell, capture: output.Capture, timeout: float
    ) -> shells.Result | None:
        """Through the session's bash (see ``bashsession``); None where the sandbox has no
        bash. This executor's helper for the sandbox serves the call (started now if it is
        not running, or joined if it is being started); while it is busy with another call
        of the session, a helper of this call's own does (it waits on the session's lock,
        with this call's timeout counting)."""
        # A frozen sandbox's helper is frozen with it (where a pause keeps processes; else the
        # helper is gone with the pod, and entering says the sandbox is not running).
        if self.runtime.pause_keeps_processes and await self.runtime.paused(request.sandbox_id):
            raise errors.NotRunning(f"sandbox {request.sandbox_id!r} is paused: resume it first")
        server = await self.shells.get(request.sandbox_id)
        if server is None:
            return None
        if not server.lock.locked():
            try:
                return await server.run(request.command, capture, timeout)
            except shells.ServerGone as gone:
                if gone.started:
                    raise _killed_mid_call() from gone
                # It ended between two calls: this call gets a helper of its own.
        own = await shells.start(self.runtime, request.sandbox_id)
        if own is None:
            raise errors.InfrastructureError("the sandbox's shell helper did not start")
        try:
            return await own.run(request.command, capture, timeout)
        except shells.ServerGone as gone:
            if gone.started:
                raise _killed_mid_call() from gone
            raise errors.InfrastructureError(
                "the sandbox's shell helper ended before the command started"
            ) from gone
        finally:
            await own.close()

    async def poll(self, sandbox_id: str, job: str) -> execution.Reply:
        _, out, _ = await self.runtime.run(
            sandbox_id,
            scripts.argv(scripts.JOB_POLL, job, str(self.limit)),
            timeout=scripts.QUICK,
            max_bytes=self.limit + HELPER_SLACK,  # the helper runs the sandbox's own tail
        )
        report = scripts.parse_poll(out)
        if report.status == "nojob":
            raise errors.NotFound(f"no job {job} in this session")
        shown = output.tail_note(report.total_bytes, len(report.tail)) + output.text(report.tail)
        return execution.Reply(
            ok=True,
            job_id=job,
            status=report.status,
            exit_code=report.exit_code,
            output=shown,
            truncated=report.total_bytes > len(report.tail),
        )

    async def wait(self, request: execution.ShellWait) -> execution.Reply:
        job = checks.job_id(request.job_id)
        deadline = time.monotonic() + self._timeout(request.timeout, 30.0)
        delay = 0.05
        while True:
            reply = await self.poll(request.sandbox_id, job)
            if reply.status != "running" or time.monotonic() >= deadline:
                return reply
            await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 0.5)

    # ---- edit tool -------------------------------------------------------------------

    async def _read(self, sandbox_id: str, path: str) -> tuple[str, bytes]:
        _, out, _ = await self.runtime.run(
            sandbox_id,
            scripts.argv(scripts.READ, path, str(edits.MAX_FILE_BYTES + 1)),
            timeout=scripts.QUICK,
            max_bytes=edits.MAX_FILE_BYTES + HELPER_SLACK,
        )
        kind, _, body = out.partition(b"\n")
        return kind.decode(errors="replace"), body

    async def _write(self, sandbox_id: str, path: str, data: bytes) -> None:
        result, out, err = await self.runtime.run(
            sandbox_id, scripts.argv(scripts.WRITE, path), stdin=data, timeout=scripts.QUICK
        )
        if result.exit_code != 0:
            raise errors.InvalidInput(f"cannot write {path}: {output.text(out + err).strip()[:300]}")

    async def _text(self, sandbox_id: str, path: str) -> str:
        kind, body = await self._read(sandbox_id, path)
        if kind == "dir":
            raise errors.InvalidInput(f"{path} is a directory; this command needs a file")
        if kind != "file":
            raise errors.InvalidInput(f"{path} does not exist")
        return edits.decode_text(body, path)

    async def edit(self, request: execution.Edit) -> execution.Reply:
        path = checks.path(request.path)
        sid = request.sandbox_id
        match request.command:
            case "view":
                kind, body = await self._read(sid, path)
                if kind == "dir":
                    entries = scripts.parse_directory(body)
                    return execution.Reply(ok=True, output=edits.view_directory(entries, path))
                if kind != "file":
                    raise errors.InvalidInput(f"The path {path} does not exist.")
                return execution.Reply(
                    ok=True, output=edits.view_file(edits.decode_text(body, path), path, request.view_range)
                )
            case "create":
                if request.file_text is None:
                    raise errors.InvalidInput("create needs file_text")
                await self._write(sid, path, edits.create_file(request.file_text))
                return execution.Reply(ok=True, output=f"File created successfully at: {path}")
            case "str_replace":
                if request.old_str is None:
                    raise errors.InvalidInput("str_replace needs old_str")
                new_text, snippet = edits.str_replace(
                    await self._text(sid, path), request.old_str, request.new_str, path
                )
                await self._write(sid, path, edits.encode_text(new_text))
                return execution.Reply(ok=True, output=edits.edit_message(path, snippet))
            case "insert":
                text_to_insert = request.insert_text if request.insert_text is not None else request.new_str
                if request.insert_line is None or text_to_insert is None:
                    raise errors.InvalidInput("insert needs insert_line and insert_text")
                new_text, snippet = edits.insert(
                    await self._text(sid, path), request.insert_line, text_to_insert, path
                )
                await self._write(sid, path, edits.encode_text(new_text))
                return execution.Reply(ok=True, output=edits.edit_message(path, snippet))
        raise errors.InvalidInput(f"unknown edit command {request.command!r}")

    async def _streamed_finished(
        self, request: execution.Streamed, end: hostapi.End, seconds: float, failure: str | None
    ) -> None:
        tool = events.tag_of(type(request))
        metrics.exec_seconds.labels(tool).observe(seconds)
        if failure is not None:
            reply = execution.Reply(ok=False, error=commands.ErrorInfo("stopped", failure[:500]))
        else:
            reply = execution.Reply(ok=True, exit_code=end.exit_code, timed_out=end.timed_out)
        await asyncio.gather(self._touch(request.session_id), self._audit(request, reply, seconds))

    # ---- audit -----------------------------------------------------------------------

    # Long on purpose: the audit record is one event built field by field.
    async def _audit(
        self,
        request: execution.Request,
        reply: execution.Reply,
        seconds: float,
        *,
        outcome: str | None = None,
    ) -> str | None:
        """Record what the call did (or, with ``outcome="started"``, that it is about to
        run); why it could not be recorded, if it could not."""
        if not records.acts(request):
            return None  # reads, not actions: the job's start and stop are audited
        what, path, size = records.described(request)
        outcome = outcome or records.outcome(request, reply)
        event = events.CommandExecuted(
            meta=self.ctx.meta(
                command_id=ids.new_id(),
                correlation_id=request.correlation_id,
                actor=request.actor,
                session_id=request.session_id,
            ),
            session_id=request.session_id,
            sandbox_id=request.sandbox_id,
            tool=events.tag_of(type(request)),
            command=what,
            exit_code=reply.exit_code,
            duration_ms=int(seconds * 1000),
            job_id=reply.job_id,
            outcome=outcome,
            error=reply.error.code if reply.error else None,
            path=path,
            size=size,
        )
        try:
            await self.ctx.store.record(
                self.ctx.topology.aggregate_subject(subjects.EXEC, request.session_id), event
            )
        except errors.SandboxError as exc:
            metrics.audit_failures.inc()
            log.warning("executor.audit_failed", error=exc.message)
            self._audit_problem = exc.message
            return exc.message
        self._audit_problem = None
        return None


def _error_reply(exc: Exception, crashed: str) -> execution.Reply:
    """A failed request's reply (see :func:`shared.infrastructure.rpc.error_info`)."""
    return execution.Reply(ok=False, error=rpc.error_info(exc, crashed))


def _killed_mid_call() -> errors.InfrastructureError:
    return errors.InfrastructureError(
        "the shell running this command was killed before it answered "
        "(did the command kill every process in the sandbox?)"
    )
