"""``Sandbox``: run an agent's commands in a sandbox while the host's tree stays the source
of truth.

Each :meth:`Sandbox.execute`:

1. routes the command (:mod:`sbx_client.route`): git network commands and their glue run
   on the host (:mod:`sbx_client.hostrun`), with the host's credentials; the rest goes on;
2. sends what changed on the host since the last round (the code dir, the sync paths,
   the task files, the allowlisted git config) — nothing when nothing changed;
3. runs the command in the sandbox, output streamed as it comes, and gets the code
   dir's listing after it in the same answer;
4. brings back what the command created, changed or deleted in the code dir, through
   :func:`sync.apply`'s checks (in ``.git`` only history and the index; never through a
   symlink; never over a host file that changed meanwhile).

Usage::

    from sbx_client import Sandbox

    with Sandbox(cwd="/workspaces/my-repo", session="task-42") as sb:
        print(sb.execute("pytest -q")["output"])
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import stat
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from sbx_api import errors, hostapi, ids
from sbx_client import (
    archive,
    changes,
    forward,
    hostrun,
    local,
    route,
    state,
    sync,
    transport,
)

T = TypeVar("T")
Output = Callable[[str, bytes], None]
"""Called with ("stdout" | "stderr", data) as output comes."""
Progress = Callable[[str, int, int], None]
"""Called with (what, bytes sent, bytes to send) while a tree uploads (``what``: the host
directory); a first sync of a large code dir takes a while."""
_NAMES = {hostapi.STDOUT: "stdout", hostapi.STDERR: "stderr"}


OUTPUT_MAX = 16 * 1024 * 1024
"""The most output :meth:`Sandbox.execute` keeps (its first and last halves)."""


class _Bounded:
    """The first and last ``limit/2`` bytes of a stream, and how much was left out."""

    def __init__(self, limit: int) -> None:
        self.half = limit // 2
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        room = self.half - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            if len(self.tail) > self.half:
                del self.tail[: len(self.tail) - self.half]

    def text(self) -> str:
        cut = self.total - len(self.head) - len(self.tail)
        middle = f"\n[... {cut} bytes of output left out ...]\n".encode() if cut else b""
        return (bytes(self.head) + middle + bytes(self.tail)).decode(errors="replace")


class SyncError(Exception):
    """A sync step failed; the command was not run (or its files did not come back)."""


@dataclass
class Result:
    exit_code: int
    where: str
    """``sandbox`` or ``host``."""
    timed_out: bool = False
    sent: int = 0
    """Paths uploaded (changed or deleted on the host) before the command."""
    written: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)
    """Changes of the sandbox not applied on the host, and why."""
    sandbox_id: str = ""
    seconds: dict[str, float] = field(default_factory=dict)
    """Where the time went: ``up`` (scan and upload), ``run`` (the command, its output
    and the listing), ``back`` (download and apply)."""


@dataclass(frozen=True)
class Settings:
    """The client's settings, from arguments and the environment."""

    url: str
    api_key: str
    org_id: str | None = None
    user_id: str | None = None
    forward_env: str = ""
    sync_paths: tuple[Path, ...] = ()
    task_files: tuple[Path, ...] = ()
    excludes: tuple[str, ...] = sync.DEFAULT_EXCLUDES
    timeout: float = hostapi.MAX_TIMEOUT
    state_dir: Path = Path(".")

    @classmethod
    def from_env(cls, env: Mapping[str, str], **given: object) -> Settings:
        stack_dir = local.state_dir(None, env)
        # A local stack's state dir says where its gateway and key are, unless it is the
        # default one relative to where we are (inside a code dir, the sandbox could have
        # written it): then only when named in SBX_STATE_DIR.
        trusted = bool(env.get("SBX_STATE_DIR")) or stack_dir.is_absolute()
        url = given.get("url") or env.get("SBX_URL")
        if not url:
            url = (local.gateway_url(stack_dir) if trusted else None) or transport.DEFAULT_URL
        key = given.get("api_key") or env.get("SANDBOX_API_KEY")
        if not key:
            if not trusted:
                raise SyncError(
                    "no API key: set SANDBOX_API_KEY (or SBX_STATE_DIR to a local `sbx up`'s state dir)"
                )
            key = local.api_key(stack_dir)
            if not key:
                raise SyncError(
                    "no API key: set SANDBOX_API_KEY (a local `sbx up` keeps one in <state-dir>/api-key)"
                )
        extra_excludes = tuple(p for p in re.split(r"[,\s]+", env.get("SBX_SYNC_EXCLUDE", "")) if p)
        paths = [Path(p).expanduser() for p in env.get("SBX_SYNC_PATHS", "").split(os.pathsep) if p]
        tasks = [Path(p).expanduser() for p in env.get("SBX_TASK_FILES", "").split(os.pathsep) if p]
        timeout = float(env.get("SBX_EXEC_TIMEOUT", hostapi.MAX_TIMEOUT))
        try:
            hostapi.validate_timeout(timeout, what="SBX_EXEC_TIMEOUT")
        except errors.InvalidInput as exc:
            raise SyncError(exc.message) from None
        return cls(
            url=str(url),
            api_key=str(key),
            org_id=str(given.get("org_id") or env.get("SBX_ORG_ID") or "") or None,
            user_id=str(given.get("user_id") or env.get("SBX_USER_ID") or "") or None,
            forward_env=env.get("SBX_FORWARD_ENV", ""),
            sync_paths=tuple(paths),
            task_files=tuple(tasks),
            excludes=sync.DEFAULT_EXCLUDES + extra_excludes,
            timeout=timeout,
            state_dir=state.state_dir(env),
        )


def code_dir_of(cwd: Path) -> Path:
    """The code dir for a working directory: the nearest directory up from it that holds a
    ``.git`` directory (the repository's top), else the working directory itself."""
    cwd = cwd.resolve()
    for candidate in (cwd, *cwd.parents):
        if (candidate / ".git").is_dir() and not (candidate / ".git").is_symlink():
            return candidate
    return cwd


SYSTEM_DIRS = ("/etc", "/usr", "/bin", "/sbin", "/lib", "/lib64", "/boot", "/proc", "/sys", "/dev")


def not_a_code_dir(path: Path, home: Path) -> str | None:
    """Why ``path`` may not be a code dir (pure): the root, the home directory or above
    it, a hidden directory of the home (``~/.ssh``, ``~/.config``) or below one, or a
    system directory."""
    if path == Path("/") or path == home or path in home.parents:
        return "the root, or your home directory or above it"
    if home in path.parents:
        first = path.relative_to(home).parts[0]
        if first.startswith("."):
            return f"inside ~/{first}, where keys and settings live"
    if any(path == Path(d) or Path(d) in path.parents for d in SYSTEM_DIRS):
        return "a system directory"
    return None


def _reporting(chunks: Iterator[bytes], progress: Progress, what: str, total: int) -> Iterator[bytes]:
    """``chunks``, telling ``progress`` as they go (tar headers make the sum a little more
    than the files' sizes: never shown past ``total``)."""
    sent = 0
    progress(what, 0, total)
    for chunk in chunks:
        yield chunk
        sent += len(chunk)
        progress(what, min(sent, total), total)
    progress(what, total, total)


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


class Sandbox:
    """A session's sandbox, synced with a code dir on this host.

    ``keep``: :meth:`close` leaves the sandbox claimed, and what was synced is remembered
    on disk, so the next ``Sandbox`` (or ``sbx exec --keep``) with the same session
    continues where this one stopped; else :meth:`close` releases it. ``progress``: told
    how an upload of a tree goes (:data:`Progress`).
    """

    def __init__(
        self,
        cwd: str | os.PathLike[str] | None = None,
        session: str | None = None,
        *,
        keep: bool = False,
        env: Mapping[str, str] | None = None,
        settings: Settings | None = None,
        progress: Progress | None = None,
        **given: object,
    ) -> None:
        env = os.environ if env is None else env
        self.env = env
        self.progress = progress
        self.settings = settings or Settings.from_env(env, **given)
        self.cwd = Path(cwd or os.getcwd()).resolve()
        if not self.cwd.is_dir():
            raise SyncError(f"{self.cwd} is not a directory")
        self.code_dir = code_dir_of(self.cwd)
        why = not_a_code_dir(self.code_dir, Path(env.get("HOME") or Path.home()).resolve())
        if why:
            raise SyncError(
                f"{self.code_dir} is not a code dir ({why}): it would all be sent to the sandbox, and the "
                "sandbox could write there; run from a repository or a project directory"
            )
        self.session = session or f"sbx-{secrets.token_hex(8)}"
        problem = ids.session_id_problem(self.session, what="session name")
        if problem is not None:
            raise SyncError(problem)
        self.keep = keep
        try:
            self.forwarded, self.unset = forward.forwarded_env(env, self.settings.forward_env)
        except ValueError as exc:
            raise SyncError(str(exc)) from None
        self.transport = transport.Transport(
            self.settings.url,
            self.settings.api_key,
            org_id=self.settings.org_id,
            user_id=self.settings.user_id,
        )
        self._record_path = state.path_for(
            self.settings.state_dir, self.settings.url, self.session, self.code_dir
        )
        self.record = state.load(self._record_path) if keep else state.Record()
        self.root = changes.sandbox_root(self.code_dir)
        self._closed = False
        self._configs: dict[Path, tuple[object, bytes]] = {}
        self.unsent: list[tuple[str, str]] = []

    # ---- public --------------------------------------------------------------------------------

    def execute(self, command: str, timeout: float | None = None) -> dict[str, object]:
        """Run ``command``; ``{"output": combined stdout and stderr, "exit_code": int}``."""
        kept = _Bounded(OUTPUT_MAX)
        result = self.stream(command, timeout=timeout, output=lambda _, data: kept.add(data))
        return {"output": kept.text(), "exit_code": result.exit_code}

    def stream(self, command: str, *, timeout: float | None = None, output: Output | None = None) -> Result:
        """Run ``command``, handing output to ``output`` as it comes; the full result."""
        if self._closed:
            raise SyncError("this Sandbox is closed")
        write = output or (lambda _, __: None)
        decided = route.route(command, [self.code_dir], self.cwd)
        if decided.where == "host":
            assert decided.plan is not None
            try:
                code = hostrun.run(decided.plan, write=lambda data: write("stdout", data), environ=self.env)
            except hostrun.HostRunError as exc:
                write("stderr", f"sbx: {exc}\n".encode())
                code = 2
            return Result(exit_code=code, where="host")
        for attempt in range(2):
            try:
                return self._in_sandbox(command, timeout, write)
            except transport.ApiError as exc:
                # Whatever failed, what the sandbox holds is no longer known: the next
                # round sends everything again (and another sandbox now: this round does).
                self.record = state.Record()
                if exc.code != "sandbox_changed" or attempt:
                    raise
            except BaseException:
                self.record = state.Record()
                raise
        raise AssertionError("unreachable")

    def stop(self) -> None:
        """Stop the command running now (safe from another thread or a signal handler)."""
        self.transport.stop()

    def close(self) -> None:
        """Release the sandbox (unless ``keep``). Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.keep:
                state.save(self._record_path, self.record)
            else:
                self.transport.release(self.session)
                state.forget(self._record_path)
        finally:
            self.transport.close()

    def release(self) -> bool:
        """Delete the session's sandbox now, whatever ``keep`` says; False if it had none."""
        self._closed = True
        try:
            state.forget(self._record_path)
            return self.transport.release(self.session)
        finally:
            self.transport.close()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # ---- one command in the sandbox -----------------------------------------------------------

    def _in_sandbox(self, command: str, timeout: float | None, write: Output) -> Result:
        started = time.perf_counter()
        expected = self.record.sandbox_id or None
        sent, before = self._sync_up(expected)
        synced = time.perf_counter()
        tree = self.record.trees[str(self.code_dir)]
        env = dict(self.forwarded)
        env.setdefault("GIT_CONFIG_GLOBAL", f"{changes.HOST_DIR}/gitconfig")
        if self.settings.task_files:
            env.setdefault("SBX_TASK_DIR", f"{changes.HOST_DIR}/task")
        body = hostapi.RunBody(
            command=command,
            cwd=changes.sandbox_cwd(self.code_dir, self.root, self.cwd),
            env=env,
            unset=self.unset,
            timeout=timeout or self.settings.timeout,
            list_root=self.root,
            prune=[p[:-1] for p in self.settings.excludes if p.endswith("/")],
            sandbox_id=self.record.sandbox_id or None,
        )
        answer = self.transport.run(self.session, body, lambda channel, data: write(_NAMES[channel], data))
        ran = time.perf_counter()
        self.record.sandbox_id = answer.sandbox_id or answer.end.sandbox_id
        end = answer.end
        result = Result(
            exit_code=end.exit_code if end.exit_code is not None else 124,
            where="sandbox",
            timed_out=end.timed_out,
            sent=sent,
            sandbox_id=self.record.sandbox_id,
            refused=self.unsent,
        )
        self.unsent = []
        if end.timed_out:
            write("stderr", f"\n[sbx: timed out after {body.timeout:g} s: the command was killed]\n".encode())
        try:
            after = hostapi.parse_listing(answer.listing)
        except errors.InvalidInput as exc:
            raise SyncError(
                f"the sandbox's listing is malformed ({exc.message}): nothing came back"
            ) from None
        if end.message:
            write("stderr", f"\n[sbx: {end.message}]\n".encode())
        self._pull_back(
            tree, before if before is not None else tree.sandbox, after, end.listing_error, result
        )
        if self.keep:
            state.save(self._record_path, self.record)
        result.seconds = {"up": synced - started, "run": ran - synced, "back": time.perf_counter() - ran}
        return result

    # ---- up ----------------------------------------------------------------------------------

    def _sync_up(self, expected: str | None) -> tuple[int, dict[str, hostapi.Stat] | None]:
        """Send what changed; (paths sent, the code dir's listing after the upload or None
        if nothing had to go)."""
        sent = 0
        configs = self._host_configs()
        sent += self._push_files(changes.HOST_DIR, "host", configs, expected)
        if self.settings.task_files:
            sent += self._push_files(
                f"{changes.HOST_DIR}/task",
                "task",
                {p.name: _read(p) for p in self.settings.task_files},
                expected,
            )
        taken = {Path(self.root).name}
        for path in self.settings.sync_paths:
            target = changes.sandbox_root(path, taken)
            taken.add(Path(target).name)
            if path.is_dir():
                count, _ = self._push_tree(path.resolve(), target, expected, listing=False)
                sent += count
            else:
                sent += self._push_files(
                    hostapi.WORKSPACE, f"file:{path}", {Path(target).name: _read(path)}, expected
                )
        count, listing = self._push_tree(self.code_dir, self.root, expected, listing=True)
        return sent + count, listing

    def _push_tree(
        self,
        host_root: Path,
        sandbox_root: str,
        expected: str | None,
        *,
        listing: bool,
    ) -> tuple[int, dict[str, hostapi.Stat] | None]:
        key = str(host_root)
        tree = self.record.trees.get(key)
        if tree is None or tree.sandbox_root != sandbox_root or not self.record.sandbox_id:
            tree = state.Tree(sandbox_root)
            self.record.trees[key] = tree
        full = sync.scan(host_root, excludes=self.settings.excludes, cache=tree.digests)
        manifest, unsendable = changes.for_upload(full)
        self.unsent += [(p, "not sent: the name cannot travel (a newline, not UTF-8)") for p in unsendable]
        extra = self._repo_configs(host_root, full)
        if not self.record.sandbox_id:
            tree.host, tree.extra = {}, {}
        diff = sync.diff(tree.host, manifest)
        extra_now = {p: _digest(c) for p, c in extra.items()}
        extra_send = {p: c for p, c in extra.items() if tree.extra.get(p) != extra_now[p]}
        extra_gone = [p for p in tree.extra if p not in extra and p not in manifest]
        if not diff and not extra_send and not extra_gone and self.record.sandbox_id:
            tree.host = manifest
            return 0, None
        skipped: list[tuple[str, str]] = []
        deletions = changes.collapse([*diff.delete, *extra_gone])
        touched = sorted({*diff.upsert, *deletions, *extra_send})
        # What the sandbox held before is known (the last round's listing): list only
        # what this upload touched, not the whole tree.
        partial = (
            listing
            and bool(self.record.sandbox_id)
            and bool(tree.sandbox)
            and len(touched) <= hostapi.MAX_LIST_PATHS
            and not any(p.startswith(("-", "!", "(", ")")) for p in touched)
        )
        params = hostapi.PutParams(
            root=sandbox_root,
            delete=deletions,
            prune=[p[:-1] for p in self.settings.excludes if p.endswith("/")],
            listing=listing,
            list_paths=touched if partial else None,
            sandbox_id=expected,
        )
        chunks = archive.pack(host_root, diff.upsert, manifest, extra_send, skipped)
        if self.progress is not None:
            total = sum(manifest[p].size for p in diff.upsert) + sum(map(len, extra_send.values()))
            chunks = _reporting(chunks, self.progress, str(host_root), total)
        answer = self.transport.put(self.session, params, chunks)
        if answer.end.exit_code != 0:
            raise SyncError(f"the upload into {sandbox_root} failed: {answer.end.message}")
        self.record.sandbox_id = answer.sandbox_id or self.record.sandbox_id
        for path, _ in skipped:
            manifest.pop(path, None)  # not sent: the next round tries it again
        tree.host, tree.extra = manifest, extra_now
        count = len(diff.upsert) + len(diff.delete) + len(extra_send)
        if not listing:
            return count, None
        try:
            listed = hostapi.parse_listing(answer.listing)
        except errors.InvalidInput as exc:
            raise SyncError(f"the sandbox's listing is malformed ({exc.message})") from None
        if not partial:
            return count, listed
        return count, changes.merge_listing(tree.sandbox, touched, deletions, listed)

    def _push_files(self, sandbox_root: str, key: str, files: dict[str, bytes], expected: str | None) -> int:
        """Generated or single files into ``sandbox_root``; only when their content changed."""
        tree = self.record.trees.setdefault(f"[{key}]", state.Tree(sandbox_root))
        digests = {p: _digest(c) for p, c in files.items()}
        if self.record.sandbox_id and tree.extra == digests:
            return 0
        gone = [p for p in tree.extra if p not in files] if self.record.sandbox_id else []
        params = hostapi.PutParams(root=sandbox_root, delete=gone, listing=False, sandbox_id=expected)
        answer = self.transport.put(self.session, params, archive.pack(Path("/"), [], {}, files))
        if answer.end.exit_code != 0:
            raise SyncError(f"the upload into {sandbox_root} failed: {answer.end.message}")
        self.record.sandbox_id = answer.sandbox_id or self.record.sandbox_id
        tree.extra = digests
        return len(files) + len(gone)

    def _rendered(self, path: Path, *, repository: bool) -> bytes:
        """The allowlisted rendering of a git config file, remembered while the file's
        size, mtime and inode stay the same (reading it runs git)."""
        try:
            info = path.lstat()
            signature = (info.st_size, info.st_mtime_ns, info.st_ino, repository)
        except OSError:
            signature = None
        known = self._configs.get(path)
        if known is not None and signature is not None and known[0] == signature:
            return known[1]
        pairs = forward.allowed(forward.read_config(path), repository=repository)
        rendered = forward.render(pairs).encode()
        self._configs[path] = (signature, rendered)
        return rendered

    def _host_configs(self) -> dict[str, bytes]:
        home = Path(self.env.get("HOME") or Path.home())
        return {"gitconfig": self._rendered(home / ".gitconfig", repository=False)}

    def _repo_configs(self, host_root: Path, manifest: Mapping[str, sync.Entry]) -> dict[str, bytes]:
        """The allowlisted rendering of each repository's config in the tree (the code
        dir's and nested ones'), in place of the files themselves."""
        out = {}
        for git in changes.git_dirs(manifest):
            for name in ("config", "config.worktree"):
                entry = manifest.get(f"{git}/{name}")
                if entry is not None and entry.kind == "file":
                    out[f"{git}/{name}"] = self._rendered(host_root / git / name, repository=True)
        return out

    # ---- back --------------------------------------------------------------------------------

    # Each refused change is its own branch (docs/host-client.md lists the rules).
    def _pull_back(  # noqa: C901
        self,
        tree: state.Tree,
        before: Mapping[str, hostapi.Stat],
        after: dict[str, hostapi.Stat],
        incomplete: str,
        result: Result,
    ) -> None:
        plan = changes.pull_back(before, after, excludes=self.settings.excludes, deletions=not incomplete)
        if incomplete:
            result.refused.append(("", f"{incomplete}; deletions were not brought back"))
        for name in changes.not_text(after):
            result.refused.append((name, "the name is not UTF-8"))
        written: dict[str, sync.Entry | None] = {}
        if plan.upsert:
            download = archive.Download()
            try:
                try:
                    answer = self.transport.get(self.session, self.root, plan.upsert, download.write)
                except archive.TooLarge as exc:
                    self.transport.close()  # the stream was left half read
                    result.refused.append(("", f"{exc}: nothing was brought back"))
                    return
                if answer.end.message:
                    result.refused.append(("", f"the sandbox's tar said: {answer.end.message[:500]}"))
                listed = {
                    p: (after[p].kind, after[p].size if after[p].kind == "f" else None) for p in plan.upsert
                }
                for item in download.members(listed):
                    if len(item) == 2:
                        result.refused.append(item)
                        continue
                    path, entry, content = item
                    why = self._host_moved(tree, path)
                    if why is None:
                        report = sync.apply(
                            self.code_dir, sync.Changes(upsert=[path]), {path: entry}, sync.constant(content)
                        )
                        if report.refused:
                            why = report.refused[0][1]
                    if why is not None:
                        result.refused.append((path, why))
                        continue
                    result.written.append(path)
                    written[path] = self._entry_now(tree, path)
            finally:
                download.close()
        for path in plan.delete:
            why = self._host_moved(tree, path)
            if why is None:
                report = sync.apply(self.code_dir, sync.Changes(delete=[path]), {}, lambda _: b"")
                why = report.refused[0][1] if report.refused else None
            (result.refused.append((path, why)) if why else result.deleted.append(path))
        tree.host = changes.host_after(
            tree.host,
            {p: e for p, e in written.items() if e is not None},
            result.deleted,
            [p for p, _ in result.refused],
        )
        tree.sandbox = after
        for path in list(tree.extra):  # the sandbox changed a rendered copy: the next round replaces it
            if before.get(path) != after.get(path):
                tree.extra.pop(path, None)

    def _host_moved(self, tree: state.Tree, path: str) -> str | None:
        """Why not to touch ``path`` on the host: it changed there since this round's scan."""
        known = tree.host.get(path)
        try:
            info = (self.code_dir / path).lstat()
        except FileNotFoundError:
            return None if known is None or known.kind == "dir" else "deleted on the host meanwhile"
        except OSError as exc:
            return f"cannot check it on the host: {exc}"
        if known is None:
            return None if stat.S_ISDIR(info.st_mode) else "created on the host meanwhile"
        cached = tree.digests.get(path)
        if known.kind == "file" and cached is not None:
            if cached[0] != (info.st_size, info.st_mtime_ns, info.st_ino):
                return "changed on the host meanwhile (the host's version is kept)"
        return None

    def _entry_now(self, tree: state.Tree, path: str) -> sync.Entry | None:
        """The host manifest's entry for a path just written (what the next scan will see);
        the digest cache learns it too, so the next scan does not read the file again."""
        full = self.code_dir / path
        try:
            info = full.lstat()
        except OSError:
            return None
        if stat.S_ISLNK(info.st_mode):
            return sync.Entry("symlink", target=os.readlink(full))
        if stat.S_ISDIR(info.st_mode):
            return sync.Entry("dir", mode=stat.S_IMODE(info.st_mode))
        digest = sync.file_digest(full)
        tree.digests[path] = ((info.st_size, info.st_mtime_ns, info.st_ino), digest)
        return sync.Entry("file", mode=stat.S_IMODE(info.st_mode) & 0o777, digest=digest, size=info.st_size)


async def _to_thread(function: Callable[..., T], *args: object) -> T:
    import asyncio  # here: the synchronous CLI never pays for importing it

    return await asyncio.to_thread(function, *args)


class AsyncSandbox:
    """The async twin of :class:`Sandbox`: the same calls, run in a worker thread."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # Sandbox's, passed through
        self.sync = Sandbox(*args, **kwargs)

    async def execute(self, command: str, timeout: float | None = None) -> dict[str, object]:
        return await _to_thread(self.sync.execute, command, timeout)

    async def stream(
        self, command: str, *, timeout: float | None = None, output: Output | None = None
    ) -> Result:
        return await _to_thread(lambda: self.sync.stream(command, timeout=timeout, output=output))

    async def close(self) -> None:
        await _to_thread(self.sync.close)

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise SyncError(f"cannot read {path}: {exc}") from None
