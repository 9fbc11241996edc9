"""The shell programs the executor runs inside a sandbox, and the parsing of their answers.

All session state lives *inside the sandbox* (``/.sbx``): the session's bash
(:mod:`services.executor.bashsession`), which also saves its cwd and exported variables
after each call, and each async job's command, process group, output and exit code. So
any executor instance can serve any session, and an executor killed mid-session loses
neither shell state nor jobs. Edits and the ``sh`` path's calls of one session are
serialized by ``flock`` on a file in the sandbox, which the kernel releases if a holder
dies; the session bash's calls by a lock of their own (see ``bashsession``).

Scripts are POSIX sh; the user's commands run under bash when the image has it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from services.executor import bashsession
from shared.contract import execution

STATE = bashsession.STATE
JOBS = "/.sbx/jobs"
QUICK = 30.0
"""Seconds the executor allows its own short scripts in a sandbox (job lists, kills, edits)."""

#: Re-executes the given program under bash if present (else sh). $1 is the program.
_LAUNCH = 'P="$1"; shift; if command -v bash >/dev/null; then exec bash -c "$P" sbx "$@"; fi; exec sh -c "$P" sbx "$@"'

_LOCK = (
    f"[ -d {STATE} ] || mkdir -p {STATE}; "
    f'if command -v flock >/dev/null 2>&1; then exec 9>"{STATE}/lock"; flock 9; fi'
)

#: Runs $__sbx_cmd with the session's cwd and exports, and saves them when it ends.
_RUN = f"""
if [ -f {STATE}/cwd ]; then IFS= read -r __sbx_d < {STATE}/cwd; cd "$__sbx_d" 2>/dev/null || cd /workspace
else cd "${{SBX_WORKDIR:-/workspace}}" 2>/dev/null || cd /workspace; fi
[ -f {STATE}/env ] && . {STATE}/env >/dev/null 2>&1
__sbx_save() {{
  __sbx_rc=$?
  printf '%s\\n' "$PWD" > {STATE}/cwd 2>/dev/null
  unset OLDPWD 2>/dev/null
  export -p > {STATE}/env 2>/dev/null
  exit $__sbx_rc
}}
trap __sbx_save EXIT
eval "$__sbx_cmd" 9>&-  # the lock fd stays with this shell, never with what the command starts
"""

#: A ``shell`` call in a sandbox without bash (run by sh; the command on stdin): the cwd and
#: exported variables carry over, through the same files the session's bash saves.
SHELL = f"""
{_LOCK}
__sbx_cmd=$(cat; printf x); __sbx_cmd=${{__sbx_cmd%x}}
exec </dev/null 2>&1
{_RUN}"""

JOB_START = f"""
J={JOBS}/$1
mkdir -p "$J" || exit 97
cat > "$J/cmd"
B=$(command -v bash || command -v sh)
cd "$(cat {STATE}/cwd 2>/dev/null || echo "${{SBX_WORKDIR:-/workspace}}")" 2>/dev/null || cd /workspace
S=$(command -v setsid || true)
$S "$B" -c '
  J=$1; echo $$ > "$J/pgid"
  [ -f {STATE}/env ] && . {STATE}/env >/dev/null 2>&1
  "$0" -c "$(cat "$J/cmd")" > "$J/out" 2>&1 < /dev/null
  echo $? > "$J/rc.tmp" && mv -f "$J/rc.tmp" "$J/rc"
' "$B" "$J" > /dev/null 2>&1 < /dev/null &
i=0; while [ ! -s "$J/pgid" ] && [ $i -lt 500 ]; do sleep 0.01; i=$((i+1)); done
"""

#: First line: status; second: total output size; then the output's last $2 bytes.
JOB_POLL = f"""
J={JOBS}/$1
[ -d "$J" ] || {{ echo nojob; exit 0; }}
if [ -f "$J/rc" ]; then echo "exited $(cat "$J/rc")"
elif [ -f "$J/stopped" ]; then echo stopped
elif [ -s "$J/pgid" ] && kill -0 "$(cat "$J/pgid")" 2>/dev/null; then echo running
elif [ -f "$J/rc" ]; then echo "exited $(cat "$J/rc")"  # it ended between the two looks
else echo lost; fi
{{ wc -c < "$J/out"; }} 2>/dev/null || echo 0
tail -c "$2" "$J/out" 2>/dev/null
"""

JOB_STOP = f"""
J={JOBS}/$1
[ -d "$J" ] || exit 3
[ -f "$J/rc" ] && exit 0
touch "$J/stopped"
P=$(cat "$J/pgid" 2>/dev/null); [ -n "$P" ] || exit 0
kill -TERM -- "-$P" 2>/dev/null
i=0; while kill -0 -- "-$P" 2>/dev/null && [ $i -lt 30 ]; do sleep 0.1; i=$((i+1)); done
kill -KILL -- "-$P" 2>/dev/null
exit 0
"""

#: The ids of the jobs still running, one a line (what an idle pause must not freeze).
JOB_LIST = f"""
[ -d {JOBS} ] || exit 0
for J in {JOBS}/*/; do
  J=${{J%/}}
  [ -f "$J/rc" ] || [ -f "$J/stopped" ] && continue
  [ -s "$J/pgid" ] && kill -0 "$(cat "$J/pgid")" 2>/dev/null && echo "${{J##*/}}"
done
exit 0
"""

DIR_ENTRIES = 2000
"""Most entries of a directory the edit tool's ``view`` shows."""

#: First line: ``file``, ``dir`` or ``missing``; then the file's bytes or the listing.
READ = f"""
{_LOCK}
if [ -d "$1" ]; then echo dir; cd "$1" && find . -mindepth 1 -maxdepth 2 -not -path '*/.*' \\( -type d -printf 'd %P\\n' -o -printf 'f %P\\n' \\) 2>/dev/null | head -n {DIR_ENTRIES}
elif [ -f "$1" ]; then echo file; head -c "$2" -- "$1"
else echo missing; fi
"""

WRITE = f"""
{_LOCK}
mkdir -p -- "$(dirname -- "$1")" && cat > "$1"
"""


def argv(script: str, *args: str) -> list[str]:
    """Command line that runs ``script`` (under bash if the image has it) with ``args``."""
    return ["/bin/sh", "-c", _LAUNCH, "sbx-launch", script, *args]


@dataclass(frozen=True)
class JobReport:
    status: execution.JobStatus | Literal["nojob"]
    exit_code: int | None
    total_bytes: int
    tail: bytes


_STATUSES: dict[str, execution.JobStatus | Literal["nojob"]] = {
    "running": "running",
    "exited": "exited",
    "stopped": "stopped",
    "lost": "lost",
    "nojob": "nojob",
}
_INT = re.compile(r"-?[0-9]{1,9}")


def parse_poll(raw: bytes) -> JobReport:
    status_line, _, rest = raw.partition(b"\n")
    size_line, _, tail = rest.partition(b"\n")
    words = status_line.decode(errors="replace").split()
    status = _STATUSES.get(words[0], "lost") if words else "lost"
    code = int(words[1]) if status == "exited" and len(words) > 1 and _INT.fullmatch(words[1]) else None
    size = int(size_line.strip()) if re.fullmatch(rb"[0-9]{1,18}", size_line.strip()) else len(tail)
    return JobReport(status, code, size, tail)


def parse_directory(raw: bytes) -> list[tuple[str, str]]:
    """The READ script's directory answer as (name, ``dir`` or ``file``): its first
    :data:`DIR_ENTRIES` lines only, whatever a replaced ``find`` or ``head`` wrote."""
    entries: list[tuple[str, str]] = []
    for line in raw.split(b"\n", DIR_ENTRIES)[:DIR_ENTRIES]:
        if len(line) > 2 and line[:2] in (b"d ", b"f "):
            entries.append((line[2:].decode(errors="replace"), "dir" if line[:1] == b"d" else "file"))
    return entries
