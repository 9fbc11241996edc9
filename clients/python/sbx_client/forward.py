"""What reaches the sandbox from the host: environment variables only by name
(``SBX_FORWARD_ENV``, empty by default), and git config through exact key allowlists.

From the host's ``~/.gitconfig`` only identity and everyday settings; from a repository's
``.git/config`` (and ``config.worktree``) also what git needs there: formats, branches,
remote URLs and fetch refspecs. Aliases, ``core.sshCommand``, ``core.askpass``, hooks
paths, credential helpers, includes, ``http.*`` and ``url.*`` never go in, and any
value with ``user:pass@`` is dropped. Files are read with git's own parser
(``git config --file F --list -z``, which does not follow includes); a file git cannot
parse gives an empty config.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Mapping
from pathlib import Path

HOST_KEYS = {
    "user.name", "user.email", "init.defaultbranch", "pull.rebase", "pull.ff", "push.default",
    "push.autosetupremote", "core.autocrlf", "core.eol", "core.safecrlf", "core.filemode",
    "core.ignorecase", "merge.conflictstyle", "diff.algorithm", "rebase.autostash",
    "fetch.prune", "color.ui", "commit.gpgsign",
}  # fmt: skip
REPO_KEYS = HOST_KEYS | {
    "core.repositoryformatversion", "core.bare", "core.logallrefupdates", "extensions.objectformat",
}  # fmt: skip
REPO_PATTERNS = (
    re.compile(r"branch\.[^\n]+\.(remote|merge|rebase|pushremote)"),
    re.compile(r"remote\.[^\n]+\.(url|pushurl|fetch|push|tagopt|prune)"),
)
CREDENTIALS_IN_URL = re.compile(r"://[^/@\s]*:[^/@\s]*@|^https?://[^/]*@|\?")
"""``user:pass@`` anywhere, any user part of an http(s) URL (a token as the user name),
any query string (``?private_token=``)."""
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def forwarded_env(host: Mapping[str, str], names: str) -> tuple[dict[str, str], list[str]]:
    """(variables to set in the sandbox, names to unset there) for ``SBX_FORWARD_ENV``
    (comma or space separated names). A named variable the host does not have is unset in
    the sandbox, so a stale value never lingers in a reused one."""
    wanted = [n for n in re.split(r"[,\s]+", names.strip()) if n]
    bad = [n for n in wanted if not _ENV_NAME.fullmatch(n)]
    if bad:
        raise ValueError(f"SBX_FORWARD_ENV: not variable names: {', '.join(bad)}")
    present = {n: host[n] for n in wanted if n in host}
    return present, [n for n in wanted if n not in host]


def read_config(path: Path) -> list[tuple[str, str]] | None:
    """(key, value) pairs of a git config file, in order; None if git cannot parse it."""
    if not path.is_file():
        return []
    done = subprocess.run(
        ["git", "config", "--file", str(path), "--no-includes", "--list", "-z"],
        capture_output=True,
        check=False,
        env={"PATH": "/usr/bin:/bin", "GIT_CONFIG_NOSYSTEM": "1", "HOME": "/nonexistent"},
    )
    if done.returncode != 0:
        return None
    pairs = []
    for entry in done.stdout.split(b"\0"):
        if not entry:
            continue
        key, _, value = entry.decode(errors="replace").partition("\n")
        pairs.append((key, value))  # git lowercases section and variable names, not subsections
    return pairs


def allowed(pairs: list[tuple[str, str]] | None, *, repository: bool) -> list[tuple[str, str]]:
    """The pairs that may reach the sandbox (empty for an unparsable file)."""
    if pairs is None:
        return []
    out = []
    for key, value in pairs:
        ok = key in (REPO_KEYS if repository else HOST_KEYS) or (
            repository and any(p.fullmatch(key) for p in REPO_PATTERNS)
        )
        if ok and not CREDENTIALS_IN_URL.search(value) and "\n" not in value:
            out.append((key, value))
    return out


def render(pairs: list[tuple[str, str]]) -> str:
    """A git config file with exactly these pairs (values quoted and escaped)."""
    lines: list[str] = []
    current = None
    for key, value in pairs:
        section, _, rest = key.partition(".")
        sub, _, variable = rest.rpartition(".")
        header = f'[{section} "{_escape(sub)}"]' if sub else f"[{section}]"
        if header != current:
            lines.append(header)
            current = header
        lines.append(f'\t{variable} = "{_escape(value)}"')
    return "\n".join(lines) + ("\n" if lines else "")


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')
