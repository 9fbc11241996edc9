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

#: Starts job $1. $2: its directory ('' for the session shell's saved one, with its exports);
#: $3: flags (``s``: stdin from a pipe that ``JOB_INPUT`` writes to, held open by a holder
#: process until closed; ``e``: stderr apart, in ``err``); $4: the caller's label; then
#: NAME=VALUE pairs exported for the job. The command is read from stdin. Exit 96: the id
#: is taken; 98: no such directory.
JOB_START = f"""
J={JOBS}/$1; C=$2; F=$3
mkdir -p {JOBS} && mkdir "$J" || exit 96
cat > "$J/cmd"
printf '%s' "$4" > "$J/label"
shift 4
B=$(command -v bash || command -v sh)
if [ -n "$C" ]; then cd "$C" 2>/dev/null || {{ rm -rf "$J"; exit 98; }}
else cd "$(cat {STATE}/cwd 2>/dev/null || echo "${{SBX_WORKDIR:-/workspace}}")" 2>/dev/null || cd /workspace; fi
case $F in *s*) mkfifo "$J/in" || exit 97;; esac
: > "$J/out" || exit 97
case $F in *e*) : > "$J/err" || exit 97;; esac
mkfifo "$J/started" || exit 97
S=$(command -v setsid || true)
$S "$B" -c '
  __sbx_j=$1; __sbx_c=$2; shift 2
  [ -n "$__sbx_c" ] || {{ [ -f {STATE}/env ] && . {STATE}/env >/dev/null 2>&1; }}
  for __sbx_kv; do export "$__sbx_kv"; done; unset __sbx_kv
  __sbx_in=/dev/null
  if [ -p "$__sbx_j/in" ]; then
    ( exec 3<>"$__sbx_j/in"; exec sleep 2147483647 ) </dev/null >/dev/null 2>&1 &
    echo $! > "$__sbx_j/holder"
    __sbx_in=$__sbx_j/in
  fi
  echo $$ > "$__sbx_j/pgid"; echo $$ > "$__sbx_j/started"
  if [ -f "$__sbx_j/err" ]; then "$0" -c "$(cat "$__sbx_j/cmd")" > "$__sbx_j/out" 2> "$__sbx_j/err" < "$__sbx_in"
  else "$0" -c "$(cat "$__sbx_j/cmd")" > "$__sbx_j/out" 2>&1 < "$__sbx_in"; fi
  echo $? > "$__sbx_j/rc.tmp" && mv -f "$__sbx_j/rc.tmp" "$__sbx_j/rc"
  __sbx_h=$(cat "$__sbx_j/holder" 2>/dev/null); [ -z "$__sbx_h" ] || kill "$__sbx_h" 2>/dev/null
' "$B" "$J" "$C" "$@" > /dev/null 2>&1 < /dev/null &
read -r P < "$J/started"; rm -f "$J/started"
echo "$P"
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

#: Writes stdin to job $1's input pipe, or ($2 = close) closes it (its holder ends). Exit
#: 44: no such job; 45: the job reads no input; 47: its input is closed or it has ended.
JOB_INPUT = f"""
J={JOBS}/$1
[ -d "$J" ] || exit 44
[ -p "$J/in" ] || exit 45
H=$(cat "$J/holder" 2>/dev/null)
[ -n "$H" ] && kill -0 "$H" 2>/dev/null || exit 47
if [ "$2" = close ]; then kill "$H"; exit 0; fi
exec cat > "$J/in"
"""

#: Sends signal $2 to job $1's process group (TERM and KILL mark it stopped). Exit 44: no
#: such job; 46: it has ended.
JOB_SIGNAL = f"""
J={JOBS}/$1
[ -d "$J" ] || exit 44
[ -f "$J/rc" ] && exit 46
P=$(cat "$J/pgid" 2>/dev/null); [ -n "$P" ] && kill -0 -- "-$P" 2>/dev/null || exit 46
case $2 in TERM|KILL) touch "$J/stopped";; esac
kill -s "$2" -- "-$P" 2>/dev/null || exit 46
exit 0
"""

#: The running jobs: id, pid and label (at most LABEL_MAX bytes), each ended by NUL.
JOB_DETAILS = f"""
[ -d {JOBS} ] || exit 0
for J in {JOBS}/*/; do
  J=${{J%/}}
  [ -f "$J/rc" ] || [ -f "$J/stopped" ] && continue
  P=$(cat "$J/pgid" 2>/dev/null)
  [ -n "$P" ] && kill -0 "$P" 2>/dev/null || continue
  printf '%s\\0%s\\0' "${{J##*/}}" "$P"; head -c {execution.LABEL_MAX} "$J/label" 2>/dev/null; printf '\\0'
done
exit 0
"""

#: Streams job $1's output (stderr apart if it was started so) until the job ends: from
#: the start ($2 = start) or only what comes; a job being started is waited for (5 s; its
#: output files exist before its pid does).
#: Exits with the job's exit code when it exited with one below 255; else (no such job,
#: stopped, lost, 255) with 255: then ask.
JOB_FOLLOW = f"""
J={JOBS}/$1
i=0; while [ ! -s "$J/pgid" ] && [ $i -lt 500 ]; do sleep 0.01; i=$((i+1)); done
P=$(cat "$J/pgid" 2>/dev/null); [ -n "$P" ] || exit 255
if [ "$2" = start ]; then O=+1; else O=0; fi
tail -q -c "$O" -f -s 0.02 --pid="$P" "$J/out" 2>/dev/null &
[ -f "$J/err" ] && {{ tail -q -c "$O" -f -s 0.02 --pid="$P" "$J/err" 2>/dev/null; }} >&2 &
wait
[ -f "$J/rc" ] && [ ! -f "$J/stopped" ] || exit 255
R=$(cat "$J/rc"); case $R in ''|*[!0-9]*) exit 255;; esac
[ "$R" -lt 255 ] || exit 255
exit "$R"
"""
FOLLOW_ASK = 255
"""``JOB_FOLLOW``'s exit code when the job's status must be asked for (``JOB_POLL``)."""

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


def parse_jobs(raw: bytes) -> list[execution.JobInfo]:
    """:data:`JOB_DETAILS`'s answer: what is not a job id and a pid is skipped."""
    fields = raw.split(b"\0")
    jobs: list[execution.JobInfo] = []
    for i in range(0, len(fields) - 2, 3):
        job, pid, label = fields[i : i + 3]
        if re.fullmatch(rb"[0-9a-f]{32}", job) and re.fullmatch(rb"[0-9]{1,9}", pid):
            text = label[: execution.LABEL_MAX].decode(errors="replace")
            jobs.append(execution.JobInfo(job_id=job.decode(), pid=int(pid), label=text))
    return jobs


def parse_directory(raw: bytes) -> list[tuple[str, str]]:
    """The READ script's directory answer as (name, ``dir`` or ``file``): its first
    :data:`DIR_ENTRIES` lines only, whatever a replaced ``find`` or ``head`` wrote."""
    entries: list[tuple[str, str]] = []
    for line in raw.split(b"\n", DIR_ENTRIES)[:DIR_ENTRIES]:
        if len(line) > 2 and line[:2] in (b"d ", b"f "):
            entries.append((line[2:].decode(errors="replace"), "dir" if line[:1] == b"d" else "file"))
    return entries
