"""Where a command runs: a conservative, pure function of the command text and the code dirs.

A command runs on the **host** only when it is a git network command (push, fetch, pull,
clone, ls-remote) plus glue that cannot touch files:

* an optional leading ``cd DIR &&`` (an existing directory inside the code dirs, reached
  without symlinks);
* ``echo``/``printf`` segments joined with ``&&``;
* filters fed by a pipe (grep, head, tail, sort, uniq, cut, tr, wc), each with short
  options from a fixed list and no file argument (not jq: it reads the environment and
  files on its own; not ``grep -e``: its pattern would turn the one argument into a file);
* ``>/dev/null``, ``2>/dev/null`` and ``2>&1``;
* variable prefixes that are on/off switches (``GIT_TRACE=1``).

Every local path in it (the working directory, every cd, a clone target) must resolve
inside the code dirs without symlinks, and remotes are network URLs (https, ssh, git,
``user@host:path``) or remote names, never local paths. Anything else stays in the
**sandbox**: a substitution, a subshell, a heredoc, a file redirection, another program,
another variable prefix, a ``$VAR``, a ``~``, an unquoted glob, a git option that runs a
program (``--upload-pack``, ``clone -u/-c/--template``, ``ext::`` remotes, ...), or
anything this parser does not fully understand. "Sandbox" is always the safe answer.

When the answer is host, :class:`HostPlan` says exactly what to run: argv lists (no
shell), the directory, the extra environment and which streams go to /dev/null. The
host runner executes that plan, never the text.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

SPECIAL = set("$`\\(){}[]*?~<>;!#&|\n\r\t\"'")
"""Characters with a meaning to the shell (quotes are handled by the lexer)."""
SWITCHES = {
    "GIT_TRACE", "GIT_TRACE_PACKET", "GIT_TRACE_PERFORMANCE", "GIT_TRACE_SETUP",
    "GIT_CURL_VERBOSE", "GIT_TRACE_CURL", "GIT_PROGRESS_DELAY", "GIT_FLUSH",
}  # fmt: skip
SWITCH_VALUES = {"0", "1", "true", "false"}
FILTERS: dict[str, tuple[frozenset[str], frozenset[str], int]] = {
    # name: (flag options, options taking a value, most positional arguments)
    "grep": (frozenset("ivcnEFwxqoHh"), frozenset("A"), 1),
    "head": (frozenset("q"), frozenset("nc"), 0),
    "tail": (frozenset("q"), frozenset("nc"), 0),
    "sort": (frozenset("rnufbVh"), frozenset("kt"), 0),
    "uniq": (frozenset("cdui"), frozenset("f"), 0),
    "cut": (frozenset("s"), frozenset("dfc"), 0),
    "tr": (frozenset("dsc"), frozenset(), 2),
    "wc": (frozenset("lwcm"), frozenset(), 0),
}
GLUE = {"echo", "printf"}
NETWORK = {"push", "fetch", "pull", "clone", "ls-remote"}
GIT_FLAGS: dict[str, frozenset[str]] = {
    "push": frozenset({
        "-f", "--force", "--force-with-lease", "-u", "--set-upstream", "--tags", "--follow-tags",
        "--all", "--delete", "-d", "--dry-run", "-n", "-q", "--quiet", "-v", "--verbose",
        "--atomic", "--porcelain", "--prune", "--no-verify", "--progress", "--no-progress",
    }),
    "fetch": frozenset({
        "--all", "--prune", "-p", "--tags", "-t", "--no-tags", "--unshallow", "-q", "--quiet",
        "-v", "--verbose", "--dry-run", "-f", "--force", "--progress", "--no-progress", "--prune-tags",
    }),
    "pull": frozenset({
        "--rebase", "--no-rebase", "--ff-only", "--ff", "--no-ff", "-q", "--quiet", "-v", "--verbose",
        "--tags", "--no-tags", "--prune", "-p", "--progress", "--no-progress",
        "--autostash", "--no-autostash",
    }),
    "clone": frozenset({
        "--single-branch", "--no-single-branch", "--no-tags", "-q", "--quiet", "-v", "--verbose",
        "--progress", "--no-checkout", "-n", "--filter=blob:none", "--filter=tree:0",
    }),
    "ls-remote": frozenset({"--heads", "--tags", "-h", "-t", "--refs", "-q", "--quiet", "--symref"}),
}  # fmt: skip
GIT_VALUED: dict[str, frozenset[str]] = {
    "push": frozenset({"--force-with-lease", "--push-option", "-o"}),
    "fetch": frozenset({"--depth", "--deepen", "--shallow-since"}),
    "pull": frozenset({"--depth"}),
    "clone": frozenset({"--depth", "--branch", "-b", "--origin", "-o", "--shallow-since"}),
    "ls-remote": frozenset(),
}
"""Options with a value (``--depth 1`` or ``--depth=1``); the value is a plain word."""
# Never listed, so never accepted: --upload-pack, --receive-pack, --exec, -u/--config/-c
# on clone, --template, --separate-git-dir, --reference, --recurse-submodules, --bare,
# --mirror, -C/-c before the subcommand, and every option not named above.


@dataclass(frozen=True)
class Step:
    argv: tuple[str, ...]
    quiet_stdout: bool = False
    quiet_stderr: bool = False
    stderr_to_stdout: bool = False


@dataclass(frozen=True)
class HostPlan:
    """What the host runs: segments in order (each a pipeline of steps), stopping at the
    first that fails, as ``&&`` would."""

    cwd: Path
    root: Path = Path("/")
    """The code dir ``cwd`` is in: host-side git looks for its repository no higher."""
    env: dict[str, str] = field(default_factory=dict)
    segments: tuple[tuple[Step, ...], ...] = ()


@dataclass(frozen=True)
class Route:
    where: Literal["host", "sandbox"]
    why: str
    plan: HostPlan | None = None


class NotHost(Exception):
    """Why a command cannot run on the host (it runs in the sandbox)."""


# ---- lexing ------------------------------------------------------------------------------

Token = tuple[str, str]  # ("word", text) or ("op", "&&" | "|" | ">/dev/null" | "2>/dev/null" | "2>&1")
REDIRECTS = {
    ">/dev/null": ">/dev/null",
    "1>/dev/null": ">/dev/null",
    "2>/dev/null": "2>/dev/null",
    "2>&1": "2>&1",
}


def lex(text: str) -> list[Token]:
    """Words and the few operators allowed on the host; anything else raises NotHost."""
    tokens: list[Token] = []
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch == " ":
            i += 1
            continue
        if text.startswith("&&", i):
            tokens.append(("op", "&&"))
            i += 2
            continue
        if ch == "|" and _operator_at(text, i):
            tokens.append(("op", "|"))
            i += 1
            continue
        matched = next((r for r in REDIRECTS if text.startswith(r, i) and _ends_word(text, i + len(r))), None)
        if matched is not None and (i == 0 or text[i - 1] == " "):
            tokens.append(("op", REDIRECTS[matched]))
            i += len(matched)
            continue
        word, i = _word(text, i)
        tokens.append(("word", word))
    return tokens


def _operator_at(text: str, i: int) -> bool:
    """``&&`` or a single ``|`` starts at ``i`` (``&``, ``||``, ``|&`` do not count)."""
    return text.startswith("&&", i) or (text.startswith("|", i) and not text.startswith(("||", "|&"), i))


def _ends_word(text: str, i: int) -> bool:
    return i >= len(text) or text[i] == " "


def _word(text: str, i: int) -> tuple[str, int]:
    out: list[str] = []
    n = len(text)
    while i < n and text[i] != " ":
        ch = text[i]
        if ch == "'":
            end = text.find("'", i + 1)
            if end < 0:
                raise NotHost("an unterminated quote")
            out.append(text[i + 1 : end])
            i = end + 1
        elif ch == '"':
            end = text.find('"', i + 1)
            if end < 0:
                raise NotHost("an unterminated quote")
            inner = text[i + 1 : end]
            if any(c in inner for c in "$`\\!"):
                raise NotHost("an expansion inside double quotes")
            out.append(inner)
            i = end + 1
        elif ch in SPECIAL:
            if ch in "&|":
                break  # an operator right after a word: the lexer's caller takes it
            raise NotHost(f"{ch!r} has a meaning to the shell")
        else:
            out.append(ch)
            i += 1
    if i < n and text[i] in "&|" and not _operator_at(text, i):
        raise NotHost(f"{text[i]!r} has a meaning to the shell")
    return "".join(out), i


# ---- parsing -----------------------------------------------------------------------------


def route(command: str, code_dirs: Sequence[Path], cwd: Path) -> Route:
    """Where ``command`` runs when the agent's working directory is ``cwd``."""
    try:
        plan = _plan(command, [_real(d) for d in code_dirs], cwd)
    except NotHost as why:
        return Route("sandbox", str(why))
    if plan is None:
        return Route("sandbox", "not a git network command")
    return Route("host", "a git network command: it needs the host's credentials", plan)


def _real(path: Path) -> Path:
    return Path(os.path.realpath(path))


def _plan(command: str, code_dirs: list[Path], cwd: Path) -> HostPlan | None:
    if not command.strip() or "\n" in command or "\r" in command or "\t" in command:
        raise NotHost("empty or multi-line")
    segments = _segments(lex(command))
    here = _inside(cwd, code_dirs, what="the working directory")
    first = segments[0]
    if len(first) == 1 and first[0][0] == ("word", "cd"):
        words = [t[1] for t in first[0] if t[0] == "word"]
        if len(words) != 2 or len(first[0]) != 2 or len(segments) < 2:
            raise NotHost("cd takes one directory and must lead into a command")
        here = _inside(here / words[1], code_dirs, what="cd's directory", directory=True)
        segments = segments[1:]
    env: dict[str, str] = {}
    planned = [_steps(segment, env, here, code_dirs) for segment in segments]
    if not any(step.argv[0] == "git" for steps in planned for step in steps):
        return None
    root = next(r for r in code_dirs if here == r or r in here.parents)
    return HostPlan(cwd=here, root=root, env=env, segments=tuple(planned))


def _segments(tokens: list[Token]) -> list[list[list[Token]]]:
    """``a | b && c``: segments (between ``&&``) of pipeline parts (between ``|``)."""
    segments: list[list[list[Token]]] = [[[]]]
    for token in tokens:
        if token == ("op", "&&"):
            segments.append([[]])
        elif token == ("op", "|"):
            segments[-1].append([])
        else:
            segments[-1][-1].append(token)
    if any(not part for segment in segments for part in segment):
        raise NotHost("an empty command around an operator")
    return segments


def _steps(
    segment: list[list[Token]], env: dict[str, str], here: Path, code_dirs: list[Path]
) -> tuple[Step, ...]:
    """One segment's pipeline: a git network command or glue first, filters after it."""
    steps: list[Step] = []
    for index, part in enumerate(segment):
        words, quiet_out, quiet_err, err_to_out = _redirections(part)
        if index == 0:
            words = _prefixes(words, env)
        if not words:
            raise NotHost("a variable assignment alone")
        name = words[0]
        if index == 0 and name == "git":
            words = _check_git(words, here, code_dirs)
        elif index == 0 and name in GLUE:
            if len(segment) > 1:
                raise NotHost("echo/printf feeding a pipe")
        elif index > 0 and name in FILTERS:
            _check_filter(words)
        else:
            raise NotHost(f"{name!r} is not a git network command or glue")
        steps.append(Step(tuple(words), quiet_out, quiet_err, err_to_out))
    return tuple(steps)


def _redirections(part: list[Token]) -> tuple[list[str], bool, bool, bool]:
    words: list[str] = []
    quiet_out = quiet_err = err_to_out = False
    seen_redirect = False
    for kind, text in part:
        if kind == "word":
            if seen_redirect:
                raise NotHost("words after a redirection")
            words.append(text)
        elif text == ">/dev/null":
            quiet_out, seen_redirect = True, True
        elif text == "2>/dev/null":
            quiet_err, seen_redirect = True, True
        elif text == "2>&1":
            err_to_out, seen_redirect = True, True
    return words, quiet_out, quiet_err, err_to_out


def _prefixes(words: list[str], env: dict[str, str]) -> list[str]:
    while words and "=" in words[0] and words[0].split("=", 1)[0].replace("_", "").isalnum():
        name, value = words[0].split("=", 1)
        if name not in SWITCHES or value.lower() not in SWITCH_VALUES:
            raise NotHost(f"the variable prefix {name}= is not an on/off switch")
        env[name] = value
        words = words[1:]
    return words


def _check_filter(words: list[str]) -> None:
    flags, valued, most = FILTERS[words[0]]
    positional = 0
    args = iter(words[1:])
    for arg in args:
        if arg.startswith("-") and len(arg) > 1 and positional == 0:
            if arg[1:].isdigit() and words[0] in ("head", "tail"):
                continue  # head -5
            letters = arg[1:]
            for at, letter in enumerate(letters):
                if letter in flags:
                    continue
                if letter in valued:
                    if at == len(letters) - 1 and next(args, None) is None:
                        raise NotHost(f"{words[0]} -{letter} needs a value")
                    break
                raise NotHost(f"{words[0]} -{letter} is not on the list")
        else:
            positional += 1
    if positional > most:
        raise NotHost(f"{words[0]} reads a file here; on the host filters only read their pipe")


def _check_git(words: list[str], here: Path, code_dirs: list[Path]) -> list[str]:
    """The git command, checked; local paths in it made absolute (git changes to the top
    of the work tree, so a relative path would name something else there)."""
    if len(words) < 2 or words[1] not in NETWORK:
        raise NotHost("git without a network subcommand (options before it are not allowed)")
    sub = words[1]
    flags, valued = GIT_FLAGS[sub], GIT_VALUED[sub]
    positional: list[str] = []
    where: list[int] = []  # the index in ``out`` of each positional argument
    out = words[:2]
    args = iter(words[2:])
    for arg in args:
        if arg == "--":
            out.append(arg)
            for rest in args:
                where.append(len(out))
                positional.append(rest)
                out.append(rest)
            break
        out.append(arg)
        if arg.startswith("-"):
            name = arg.split("=", 1)[0]
            if arg in flags or (name in flags and "=" in arg and name == "--force-with-lease"):
                continue
            if name in valued:
                value = arg.split("=", 1)[1] if "=" in arg else next(args, None)
                if value is None or value.startswith("-"):
                    raise NotHost(f"git {sub} {name} needs a value")
                if "=" not in arg:
                    out.append(value)
                continue
            raise NotHost(f"git {sub} {name} is not on the list (some options run programs)")
        where.append(len(out) - 1)
        positional.append(arg)
    for at, arg in enumerate(positional):
        checked = _check_positional(at, arg, sub, here, code_dirs)
        if checked is not None:
            out[where[at]] = checked
    return out


def _check_positional(at: int, arg: str, sub: str, here: Path, code_dirs: list[Path]) -> str | None:
    """The ``at``-th operand of ``git sub``: the remote first, a clone's target second
    (returned as the real path it must be, inside the code directories)."""
    if any(ord(c) < 32 or ord(c) == 127 for c in arg) or "%0" in arg.lower():
        raise NotHost("control characters in an argument")
    if "::" in arg:
        raise NotHost("a remote helper transport (ext::, fd::) runs a program")
    if at == 0:
        _check_remote(arg, sub)
    elif sub == "clone" and at == 1:
        return str(_inside(here / arg, code_dirs, what="the clone target", exists=False))
    return None


REMOTE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
URL = re.compile(
    r"(https?|ssh|git)://[A-Za-z0-9.-]+(:[0-9]{1,5})?(/[^\s]*)?|ssh://[A-Za-z0-9._-]+@[A-Za-z0-9.-]+(:[0-9]{1,5})?(/[^\s]*)?"
)
SCP = re.compile(r"[A-Za-z0-9._-]+@[A-Za-z0-9.-]+:[A-Za-z0-9._/~-][^\s]*")


def _check_remote(arg: str, sub: str) -> None:
    """The remote (or clone source) of a host command: a network URL of a known scheme,
    scp-like ``user@host:path``, or a remote's name (hostrun checks it is configured).
    Never a local path or ``file://``: git's local transport runs the other repository's
    hooks, and that repository may be one the sandbox planted in the tree."""
    if URL.fullmatch(arg):
        if arg.startswith(("http://", "https://")) and ("@" in arg.split("/", 3)[2] or "?" in arg):
            raise NotHost("a URL with credentials or a query in it")
        return
    if SCP.fullmatch(arg) and not arg.startswith("-"):
        return
    if sub != "clone" and REMOTE_NAME.fullmatch(arg) and not arg.startswith("-"):
        return
    raise NotHost(f"{arg!r:.60} is not a network URL or a remote name (local remotes run on the sandbox)")


def _inside(
    path: Path, code_dirs: list[Path], *, what: str, directory: bool = False, exists: bool = True
) -> Path:
    """``path`` made absolute, checked to be inside a code dir with no symlink on the way."""
    if not path.is_absolute():
        raise NotHost(f"{what} is not absolute")
    normal = Path(os.path.normpath(path))
    for root in code_dirs:
        if normal == root or root in normal.parents:
            break
    else:
        raise NotHost(f"{what} {normal} is outside the code dirs")
    probe = root
    for part in normal.relative_to(root).parts:
        probe = probe / part
        if probe.is_symlink():
            raise NotHost(f"{what} goes through a symlink ({probe})")
        if not probe.exists():
            if exists:
                raise NotHost(f"{what} {normal} does not exist")
            break
    if directory and not normal.is_dir():
        raise NotHost(f"{what} {normal} is not a directory")
    return normal
