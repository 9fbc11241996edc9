"""The shell programs the executor runs inside a sandbox, and the parsing of their answers.

All session state lives *inside the sandbox* (``/.sbx``): the shell's cwd and exported
variables after each call, and each async job's command, process group, output and
exit code. So any executor instance can serve any session, and an executor killed
mid-session loses neither shell state nor jobs. Calls of one session are serialized
by ``flock`` on a file in the sandbox, which the kernel releases if a holder dies.

Scripts are POSIX sh; the user's commands run under bash when the image has it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from shared.contract import execution
from shared.runtime import api

STATE = "/.sbx/shell"
JOBS = "/.sbx/jobs"

#: Re-executes the given program under bash if present (else sh). $1 is the program.
_LAUNCH = 'P="$1"; shift; if command -v bash >/dev/null; then exec bash -c "$P" sbx "$@"; fi; exec sh -c "$P" sbx "$@"'

_LOCK = (
    f"[ -d {STATE} ] || mkdir -p {STATE}; "
    f'if command -v flock >/dev/null 2>&1; then exec 9>"{STATE}/lock"; flock 9; fi'
)

#: Runs $__sbx_cmd with the session's cwd and exports, and saves them when it ends.
_RUN = f"""
if [ -f {STATE}/cwd ]; then IFS= read -r __sbx_d < {STATE}/cwd; cd "$__sbx_d" 2>/dev/null || cd /workspace; fi
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

# Builtins only on the hot path under bash (each fork/exec costs ~1 ms in a sandbox).
SHELL = f"""
{_LOCK}
if [ -n "$BASH_VERSION" ]; then IFS= read -r -d '' __sbx_cmd; else __sbx_cmd=$(cat; printf x); __sbx_cmd=${{__sbx_cmd%x}}; fi
exec </dev/null 2>&1
{_RUN}"""

SERVER_HELLO = b"sbx-shell-server 1\n"
OUTPUT_DIR = api.OUTPUT_DIR

#: The persistent shell server (bash only; exit 3 means "not here, use SHELL").
#: Reads requests ``<nonce>\n<command>\0`` from stdin; runs each as a background job
#: (its own process group, so a timeout kills exactly that call), with stdin from
#: /dev/null and output to a file of its own in ``OUTPUT_DIR`` where the runtime gives
#: one (local: a small tmpfs of its own, so a full /tmp or disk does not swallow the
#: output, and output beyond its size is cut there), else in /tmp; so processes the
#: command leaves behind neither hold this channel nor write into a later call's output. Answers
#: ``<nonce> started <pgid>\n``, then the output, then ``<nonce> exited <status>\n``.
SHELL_SERVER = f"""
[ -n "$BASH_VERSION" ] && command -v cat >/dev/null 2>&1 && [ -d /tmp ] && [ -w /tmp ] || exit 3
exec 2>/dev/null
set -m
[ -d {STATE} ] || mkdir -p {STATE} || exit 3
__sbx_dir=/tmp; [ -d {OUTPUT_DIR} ] && [ -w {OUTPUT_DIR} ] && __sbx_dir={OUTPUT_DIR}
__sbx_n=0
__sbx_job=
# Its executor died (SIGTERM, see runtime enter): the running call's caller is gone, so the
# call is killed, and with it the session's lock.
trap '[ -n "$__sbx_job" ] && kill -KILL -- "-$__sbx_job" 2>/dev/null; exit 143' TERM HUP
printf 'sbx-shell-server 1\\n'
while IFS= read -r __sbx_nonce && IFS= read -r -d '' __sbx_cmd; do
  __sbx_n=$((__sbx_n + 1))
  # This server's empty output files (silent calls): cleared now and then, one exec per 200 calls.
  [ $((__sbx_n % 200)) -eq 0 ] && rm -f "$__sbx_dir"/.sbx-out-$$-*
  __sbx_out=$__sbx_dir/.sbx-out-$$-$__sbx_nonce
  (
    {_LOCK}
    {_RUN}  ) </dev/null >"$__sbx_out" 2>&1 &
  __sbx_job=$!
  printf '%s started %d\\n' "$__sbx_nonce" "$__sbx_job"
  wait "$__sbx_job"
  __sbx_rc=$?
  __sbx_job=
  if [ -s "$__sbx_out" ]; then cat -- "$__sbx_out"; rm -f -- "$__sbx_out"; fi
  printf '%s exited %d\\n' "$__sbx_nonce" "$__sbx_rc"
done
rm -f "$__sbx_dir"/.sbx-out-$$-*
"""

#: Kills one shell server job's process group ($1 is the pgid the server reported).
KILL_GROUP = 'kill -KILL -- "-$1" 2>/dev/null; exit 0'

JOB_START = f"""
J={JOBS}/$1
mkdir -p "$J" || exit 97
cat > "$J/cmd"
B=$(command -v bash || command -v sh)
cd "$(cat {STATE}/cwd 2>/dev/null || echo /workspace)" 2>/dev/null || cd /workspace
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

#: First line: ``file``, ``dir`` or ``missing``; then the file's bytes or the listing.
READ = f"""
{_LOCK}
if [ -d "$1" ]; then echo dir; cd "$1" && find . -mindepth 1 -maxdepth 2 -not -path '*/.*' \\( -type d -printf 'd %P\\n' -o -printf 'f %P\\n' \\) 2>/dev/null | head -n 2000
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
