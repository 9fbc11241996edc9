"""Running a host plan (route.HostPlan): argv lists, never a shell, in the plan's directory.

Every git step runs hardened against what a sandbox could have left in the tree:
``safe.bareRepository=explicit`` (an embedded bare repository is never picked up),
hooks off (``core.hooksPath=/dev/null``), no fsmonitor, no ``ext::`` transport, and an
explicit ``--git-dir``/``--work-tree`` for the repository the directory is in, found no
higher than its code dir (a ``.git`` *file* pointing elsewhere, or alternates, are
refused), network transports only (https, http, ssh, git), a remote name only if the
repository has that remote, no prompts, redacted traces. ``clone`` gets no template
directory. The host's own global git config (identity, credential helpers) applies: that
is the point of running there. Filters get only PATH and locale variables.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, cast

from sbx_client import route

HARDENING = (
    "-c", "safe.bareRepository=explicit", "-c", "core.hooksPath=/dev/null", "-c", "core.fsmonitor=false",
    # Network transports only: the local (file) transport would run the other repository's
    # hooks (git drops -c settings before starting receive-pack), and ext:: runs anything.
    "-c", "protocol.allow=never", "-c", "protocol.https.allow=always", "-c", "protocol.http.allow=always",
    "-c", "protocol.ssh.allow=always", "-c", "protocol.git.allow=always",
)  # fmt: skip
GIT_ENV = {"GIT_TERMINAL_PROMPT": "0", "GIT_TRACE_REDACT": "1", "GIT_CONFIG_NOSYSTEM": "1"}
"""Never prompt the host's user (a push to a look-alike host would ask for a password);
traces never show credentials; no system-wide config."""
TIMEOUT = 600.0
"""Longest a host command may run (a push of a large history included)."""
OUTPUT_LIMIT = 4 * 1024 * 1024
"""Most output passed on; the rest is dropped and said so."""
FILTER_ENV_KEYS = ("PATH", "LANG", "LC_ALL", "LC_CTYPE")
"""Filters (grep, sort, ...) get only these of the host's variables."""


class HostRunError(Exception):
    pass


def repository(start: Path, root: Path) -> Path:
    """The work tree that ``start`` is in, looked for no higher than the code dir ``root``
    (a repository above it, say a dotfiles repo in $HOME, is never used). Its ``.git``
    must be a directory, and hold no alternates the host did not make."""
    for candidate in (start, *start.parents):
        if candidate != root and root not in candidate.parents:
            break
        dot_git = candidate / ".git"
        if dot_git.is_symlink() or dot_git.is_file():
            raise HostRunError(f"{dot_git} is not a directory (a gitfile or a link): not run on the host")
        if dot_git.is_dir():
            if (dot_git / "objects" / "info" / "alternates").exists():
                raise HostRunError(
                    f"{dot_git} borrows objects from elsewhere (alternates): not run on the host"
                )
            return candidate
    raise HostRunError(f"{start} is not inside a git repository within the code dir {root}")


def git_argv(step: route.Step, cwd: Path, root: Path) -> list[str]:
    sub, args = step.argv[1], list(step.argv[2:])
    if sub == "clone":
        return ["git", *HARDENING, "clone", "--template=", *args]
    tree = repository(cwd, root)
    base = ["git", *HARDENING, f"--git-dir={tree / '.git'}", f"--work-tree={tree}"]
    remote = next((a for a in args if not a.startswith("-")), None)
    if remote is not None and route.REMOTE_NAME.fullmatch(remote):
        found = subprocess.run(
            [*base, "config", "--get", f"remote.{remote}.url"], capture_output=True, check=False
        )
        if found.returncode != 0:
            raise HostRunError(f"{remote!r} is not a remote of {tree}: not run on the host")
    return [*base, sub, *args]


def run(
    plan: route.HostPlan,
    *,
    write: Callable[[bytes], None],
    timeout: float = TIMEOUT,
    limit: int = OUTPUT_LIMIT,
    environ: Mapping[str, str] | None = None,
) -> int:
    """Run the plan's segments like ``a && b``; each a pipeline. Output of the last step of
    each pipeline goes to ``write`` as it comes (at most ``limit`` bytes); returns the exit
    code (124 when ``timeout`` ran out: every process of the plan is killed)."""
    env = {**(os.environ if environ is None else environ), **GIT_ENV, **plan.env}
    budget = _Budget(write, limit, time.monotonic() + timeout)
    code = 0
    for segment in plan.segments:
        code = _pipeline(segment, plan, env, budget)
        if code != 0:
            break
    return code


class _Budget:
    """Output and time left for a plan."""

    def __init__(self, write: Callable[[bytes], None], limit: int, deadline: float) -> None:
        self.write_through, self.left, self.deadline = write, limit, deadline
        self.cut = False

    def write(self, data: bytes) -> None:
        if self.left > 0:
            self.write_through(data[: self.left])
        if len(data) > self.left and not self.cut:
            self.cut = True
            self.write_through(b"\n[output cut: more than the host passes on]\n")
        self.left = max(0, self.left - len(data))


def _pipeline(
    steps: tuple[route.Step, ...], plan: route.HostPlan, env: dict[str, str], budget: _Budget
) -> int:
    """Like bash: each step's stdout feeds the next; the last step's output (stderr merged
    unless redirected) streams to ``write``; earlier steps' stderr follows at the end."""
    processes: list[subprocess.Popen[bytes]] = []
    previous = None
    with tempfile.TemporaryFile() as errors_of_earlier:
        for index, step in enumerate(steps):
            last = index == len(steps) - 1
            git = step.argv[0] == "git"
            argv = git_argv(step, plan.cwd, plan.root) if git else list(step.argv)
            step_env = env if git else {k: v for k, v in env.items() if k in FILTER_ENV_KEYS}
            stdout = subprocess.DEVNULL if step.quiet_stdout else subprocess.PIPE
            if step.quiet_stderr:
                stderr: int | IO[bytes] = subprocess.DEVNULL
            elif step.stderr_to_stdout or last:
                stderr = subprocess.STDOUT
            else:
                stderr = errors_of_earlier
            proc = subprocess.Popen(
                argv,
                cwd=plan.cwd,
                env=step_env,
                stdin=previous or subprocess.DEVNULL,
                stdout=stdout,
                stderr=stderr,
                start_new_session=True,  # a timeout kills git and the helpers it started
            )
            if previous is not None:
                previous.close()
            previous = proc.stdout if not last else None
            processes.append(proc)
        final = processes[-1]
        timer = threading.Timer(max(0.0, budget.deadline - time.monotonic()), _kill_all, (processes,))
        timer.start()
        try:
            if final.stdout is not None:
                reader = cast(io.BufferedReader, final.stdout)  # Popen's pipes are buffered (bufsize -1)
                for chunk in iter(lambda: reader.read1(65536), b""):
                    budget.write(chunk)
            codes = [p.wait() for p in processes]
        finally:
            timer.cancel()
        errors_of_earlier.seek(0)
        if leftover := errors_of_earlier.read():
            budget.write(leftover)
    if time.monotonic() >= budget.deadline:
        budget.write(b"\n[timed out on the host: the command was killed]\n")
        return 124
    return codes[-1]


def _kill_all(processes: list[subprocess.Popen[bytes]]) -> None:
    for proc in processes:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
