"""Running a host plan (route.HostPlan): argv lists, never a shell, in the plan's directory.

Every git step runs hardened against what a sandbox could have left in the tree:
``safe.bareRepository=explicit`` (an embedded bare repository is never picked up),
hooks off (``core.hooksPath=/dev/null``), no fsmonitor, no ``ext::`` transport, and an
explicit ``--git-dir``/``--work-tree`` for the repository the directory is in (a ``.git``
*file* pointing elsewhere is refused). ``clone`` gets no template directory. The host's
own global git config (identity, credential helpers) applies: that is the point of
running there.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

from sbx.client import route

HARDENING = (
    "-c", "safe.bareRepository=explicit", "-c", "core.hooksPath=/dev/null", "-c", "core.fsmonitor=false",
    "-c", "protocol.ext.allow=never",
)  # fmt: skip


class HostRunError(Exception):
    pass


def repository(start: Path) -> Path:
    """The work tree that ``start`` is in (its ``.git`` must be a directory)."""
    for candidate in (start, *start.parents):
        dot_git = candidate / ".git"
        if dot_git.is_symlink() or dot_git.is_file():
            raise HostRunError(f"{dot_git} is not a directory (a gitfile or a link): not run on the host")
        if dot_git.is_dir():
            return candidate
    raise HostRunError(f"{start} is not inside a git repository")


def git_argv(step: route.Step, cwd: Path) -> list[str]:
    sub, args = step.argv[1], list(step.argv[2:])
    if sub == "clone":
        return ["git", *HARDENING, "clone", "--template=", *args]
    tree = repository(cwd)
    return ["git", *HARDENING, f"--git-dir={tree / '.git'}", f"--work-tree={tree}", sub, *args]


def run(plan: route.HostPlan, *, write: Callable[[bytes], None]) -> int:
    """Run the plan's segments like ``a && b``; each a pipeline. Output of the last step of
    each pipeline goes to ``write`` as it comes; returns the exit code."""
    env = {**os.environ, **plan.env}
    code = 0
    for segment in plan.segments:
        code = _pipeline(segment, plan.cwd, env, write)
        if code != 0:
            break
    return code


def _pipeline(
    steps: tuple[route.Step, ...], cwd: Path, env: dict[str, str], write: Callable[[bytes], None]
) -> int:
    """Like bash: each step's stdout feeds the next; the last step's output (stderr merged
    unless redirected) streams to ``write``; earlier steps' stderr follows at the end."""
    processes: list[subprocess.Popen[bytes]] = []
    previous = None
    with tempfile.TemporaryFile() as errors_of_earlier:
        for index, step in enumerate(steps):
            last = index == len(steps) - 1
            argv = git_argv(step, cwd) if step.argv[0] == "git" else list(step.argv)
            stdout = subprocess.DEVNULL if step.quiet_stdout else subprocess.PIPE
            if step.quiet_stderr:
                stderr: int | IO[bytes] = subprocess.DEVNULL
            elif step.stderr_to_stdout or last:
                stderr = subprocess.STDOUT
            else:
                stderr = errors_of_earlier
            proc = subprocess.Popen(
                argv, cwd=cwd, env=env, stdin=previous or subprocess.DEVNULL, stdout=stdout, stderr=stderr
            )
            if previous is not None:
                previous.close()
            previous = proc.stdout if not last else None
            processes.append(proc)
        final = processes[-1]
        if final.stdout is not None:
            for chunk in iter(lambda: final.stdout.read1(65536), b""):  # type: ignore[union-attr]
                write(chunk)
        codes = [p.wait() for p in processes]
        errors_of_earlier.seek(0)
        if leftover := errors_of_earlier.read():
            write(leftover)
    return codes[-1]
