"""The session's bash: one live bash per sandbox, owned by the sandbox, that runs every
``shell`` call of the session, so all of bash's state carries over between calls.

Processes, all inside the sandbox, all forks of one bash (so ``$$`` is the same in every
call and each has the session's state in memory):

- **R**, the anchor, started by the first relay under ``setsid``: it restores the cwd and
  exports last saved (an older session's, or what the ``sh`` path saved), forks B and
  then only waits, so that ``$$`` lives; a signal sent to ``$$`` is passed on to B.
- **B**, the server: reads each request from ``STATE/req`` and runs the command with
  ``eval`` at its own top level (nothing is a function-local or subshell change), output
  to a file of the call's own, and answers on ``STATE/reply``.
- **C**, the backup: before each call B forks a copy of itself, which blocks on a FIFO
  that only B holds open for writing. If B ends during a call (``exit``, ``set -e``, a
  timeout's kill, ``exec``), C sees end of file and takes B's place with the state from
  before that call: it forks a new B and becomes its waiter. Otherwise B kills C when
  the next copy is made.
- **W**, B's waiter (R for the first B, then the C that took over): reports how B ended,
  with its exact status.

The **relay** (``SERVER``) is the executor's end: one per executor and sandbox, started
through the runtime's exec. It takes the session's lock, starts the session if none runs,
passes requests and answers, and reads each call's output file. It holds no state, so an
executor killed between two calls loses nothing, and a call can land on any executor.

The answers come from inside the sandbox and are untrusted (see ``shells``).
"""

from __future__ import annotations

from shared.runtime import api

STATE = "/.sbx/shell"
OUTPUT_DIR = api.OUTPUT_DIR
HELLO = b"sbx-shell-server 2\n"
PREPARE = ": sbx-prepare"
"""The warm-up call of a pool sandbox's shell: answered, not run, not a user's call."""


def _fill(text: str) -> str:
    return text.replace("@S@", STATE).replace("@OUT@", OUTPUT_DIR)


# Code of the session's processes. It runs amid the user's state: builtins are called as
# ``builtin``, no glob, no function of ours, no error that the user's ``set -e`` could
# turn into an exit (errexit, nounset and tracing are set aside between calls).

#: W: forks B from this process's state and reports how it ended. $__sbx_b is B's pid.
_HOLD = r"""
builtin set -m
( builtin eval "$__sbx_loop" ) &
__sbx_b=$!
builtin printf '%s\n' "$__sbx_b" >| "$__sbx_dir/.sbx-live" 2>/dev/null
while :; do
  builtin wait "$__sbx_b"
  builtin kill -0 "$__sbx_b" 2>/dev/null || break
done
builtin wait "$__sbx_b"
__sbx_rc=$?
builtin printf '%s ended %d\n' "$__sbx_b" "$__sbx_rc" >&"$__sbx_rp"
"""

#: C: holds B's state from before the running call; takes B's place if B ends in it.
#: Saves the cwd and exports first (async jobs start from them, and so does a new session
#: if this one is lost); a USR1 from B (a newer copy exists) ends it, never mid-save.
_BACKUP = r"""
builtin trap -p >| "$__sbx_dir/.sbx-traps" 2>/dev/null
builtin trap '__sbx_q=1' USR1
[ -n "$__sbx_w" ] && command exec {__sbx_w}>&-
command exec </dev/null
[ "$PWD" = "${__sbx_pw-}" ] || builtin printf '%s\n' "$PWD" >| @S@/cwd 2>/dev/null
builtin export -p >| @S@/env 2>/dev/null
[ -n "${__sbx_q-}" ] && builtin exit 0
builtin trap 'builtin exit 0' USR1
command exec {__sbx_a}<@S@/alive
until IFS= builtin read -r -u "$__sbx_a" __sbx_m; [ $? -eq 1 ]; do :; done
command exec {__sbx_a}<&-
builtin trap - USR1
__sbx_tf=$__sbx_dir/.sbx-traps __sbx_w= __sbx_c= __sbx_c0=
builtin shopt -u expand_aliases
builtin eval "$__sbx_hold"
builtin exit 0
"""

#: B: serves the session's calls, one after another, at its own top level.
_LOOP = r"""
builtin set +m
builtin trap - TERM INT HUP QUIT USR1 USR2 ALRM
if [ -n "${__sbx_tf-}" ]; then . "$__sbx_tf"; fi
__sbx_tf= __sbx_w= __sbx_c= __sbx_c0=
while :; do
  # A copy of this state (double fork: $! stays the user's), ending the one before.
  __sbx_n=$(builtin set -m; ( builtin eval "$__sbx_backup" ) >/dev/null 2>&1 & builtin printf '%s' "$!")
  [ -n "$__sbx_w" ] || command exec {__sbx_w}>@S@/alive
  [ -n "$__sbx_c0" ] && builtin kill -KILL "$__sbx_c0" 2>/dev/null
  [ -n "$__sbx_c" ] && builtin kill -USR1 "$__sbx_c" 2>/dev/null
  __sbx_c0=$__sbx_c __sbx_c=$__sbx_n __sbx_pw=$PWD
  IFS= builtin read -r -u "$__sbx_rq" __sbx_nonce || continue
  IFS= builtin read -r -d '' -u "$__sbx_rq" __sbx_cmd || continue
  __sbx_out=$__sbx_dir/.sbx-out-$__sbx_nonce
  IFS=' ' builtin read -r __sbx_t _ < /proc/uptime || __sbx_t=0.00
  IFS=' ' builtin read -r _ _ _ _ __sbx_l < /proc/loadavg || __sbx_l=0
  builtin printf '%s started %s %s %s\n' "$__sbx_nonce" "$BASHPID" "$__sbx_l" "${__sbx_t/./}" >&"$__sbx_rp"
  if [ -n "${PWD-}" ] && ! [ -d "$PWD" ]; then
    builtin printf '[the working directory %s no longer exists; now in /workspace]\n' "$PWD" >>"$__sbx_out"
    builtin cd /workspace 2>/dev/null || builtin cd /
  fi
  if [ "$__sbx_cmd" = ': sbx-prepare' ]; then  # (the pool's warm-up call: no user's yet)
    builtin printf '%s exited 0\n' "$__sbx_nonce" >&"$__sbx_rp"
    continue
  fi
  if [ -z "${__sbx_used-}" ]; then
    __sbx_used=1
    : >| @S@/used  # a user's call ran in this shell: losing it loses state
  fi
  builtin shopt -s expand_aliases
  case ${__sbx_f-} in *e*) builtin set -e ;; esac
  case ${__sbx_f-} in *u*) builtin set -u ;; esac
  case ${__sbx_f-} in *v*) builtin set -v ;; esac
  __sbx_x=; case ${__sbx_f-} in *x*) __sbx_x='builtin set -x
' ;; esac
  command exec >>"$__sbx_out" 2>&1  # (not the eval's own: an EXIT trap's output would be lost)
  builtin eval "$__sbx_x$__sbx_cmd" {__sbx_rq}<&- {__sbx_rp}>&- {__sbx_w}>&- </dev/null
  { __sbx_rc=$? __sbx_f=$-; builtin set +euvx; } 2>/dev/null
  command exec >/dev/null 2>&1
  builtin printf '%s exited %d\n' "$__sbx_nonce" "$__sbx_rc" >&"$__sbx_rp"
done
"""

#: R: $1 the output directory; $2-$4 the programs above.
_ANCHOR = r"""
command exec </dev/null >/dev/null 2>&1
__sbx_dir=$1 __sbx_loop=$2 __sbx_backup=$3 __sbx_hold=$4
builtin set --
command exec {__sbx_rq}<>@S@/req {__sbx_rp}<>@S@/reply {__sbx_an}<>@S@/anchor || builtin exit 3
builtin cd -- "${SBX_WORKDIR:-/workspace}" 2>/dev/null || builtin cd /workspace 2>/dev/null || builtin cd /
if [ -f @S@/cwd ]; then IFS= builtin read -r __sbx_d < @S@/cwd && builtin cd -- "$__sbx_d" 2>/dev/null; fi
if [ -f @S@/env ]; then . @S@/env; fi
builtin unset __sbx_d
IFS= builtin read -r __sbx_st < /proc/self/stat
__sbx_st=${__sbx_st##*) }
builtin set -f
builtin set -- $__sbx_st
builtin set +f
builtin printf '%s %s\n' "$BASHPID" "${20}" >| @S@/session
builtin set --
builtin unset __sbx_st
for __sbx_g in TERM INT HUP QUIT USR1 USR2 ALRM; do
  builtin trap "IFS= builtin read -r __sbx_g < \"\$__sbx_dir/.sbx-live\" &&
    builtin kill -$__sbx_g \"\$__sbx_g\"" "$__sbx_g"
done
builtin unset __sbx_g
builtin shopt -s expand_aliases
builtin eval "$__sbx_hold"
while :; do IFS= builtin read -r -u "$__sbx_an" _; done
"""

ANCHOR = _fill(_ANCHOR)
LOOP = _fill(_LOOP)
BACKUP = _fill(_BACKUP)
HOLD = _fill(_HOLD)

#: Kills what one call started: $1 B, $2 the last pid before the call, $3 its start in
#: clock ticks. B is stopped first (it forks no more), then every process of the session's
#: process session started since (by pid, or by start time if pids wrapped) is killed,
#: twice over, and B last: its death makes the backup take over, whose new processes
#: must not be taken for the call's. What the command detached into a session of its own
#: (``setsid``) is not touched.
_KILL = r"""
__sbx_stat() {  # $1 a pid: its /proc stat fields after the name in __sbx_st (3 session, 19 start)
  local line IFS=$' \t\n'
  IFS= read -r line 2>/dev/null < "/proc/$1/stat" || return 1
  line=${line##*) }; set -f; __sbx_st=($line); set +f
}

__sbx_each() {  # $1 a session id: the pids of its processes, but its leader, in __sbx_in
  local f p
  __sbx_in=()
  for f in /proc/[0-9]*/stat; do
    p=${f#/proc/}; p=${p%/stat}
    __sbx_stat "$p" && [ "${__sbx_st[3]}" = "$1" ] && [ "$p" != "$1" ] && __sbx_in+=("$p")
  done
  return 0
}

__sbx_kill() {
  local b=$1 l=$2 t=$3 sid= p pass
  case $b in ''|0|*[!0-9]*) return 0 ;; esac
  __sbx_stat "$b" && sid=${__sbx_st[3]}
  kill -STOP "$b" 2>/dev/null
  if [ -n "$sid" ] && [ "$sid" != 0 ]; then
    for pass in 1 2; do
      __sbx_each "$sid"
      for p in "${__sbx_in[@]}"; do
        [ "$p" != "$b" ] && __sbx_stat "$p" || continue
        if [ "${__sbx_st[19]}" -gt "$t" ] || { [ "${__sbx_st[19]}" -eq "$t" ] && [ "$p" -gt "$l" ]; }; then
          kill -KILL "$p" 2>/dev/null
        fi
      done
    done
  fi
  kill -KILL "$b" 2>/dev/null
}
"""

KILL = _KILL + '__sbx_kill "$1" "$2" "$3"; exit 0\n'

#: The relay: $1-$4 the session's programs (see ``BOOT``). Reads requests ``<nonce>\n<command>\0``;
#: answers ``<nonce> started <B> <last pid> <start ticks>\n``, then the output, then
#: ``<nonce> exited <status>\n``. Exit 3: no session shell can run here (use ``sh``).
_SERVER = (
    _KILL
    + r"""
[ -n "$BASH_VERSION" ] && command -v cat >/dev/null 2>&1 && command -v mkfifo >/dev/null 2>&1 || exit 3
exec 2>/dev/null
__sbx_s=@S@
[ -d "$__sbx_s" ] || mkdir -p "$__sbx_s" || exit 3
__sbx_dir=/tmp; [ -d @OUT@ ] && [ -w @OUT@ ] && __sbx_dir=@OUT@
[ -d "$__sbx_dir" ] && [ -w "$__sbx_dir" ] || exit 3
for __sbx_f in req reply anchor alive; do
  __sbx_f=$__sbx_s/$__sbx_f
  [ -p "$__sbx_f" ] && continue
  [ -e "$__sbx_f" ] && rm -f "$__sbx_f"
  mkfifo -m 600 "$__sbx_f" || [ -p "$__sbx_f" ] || exit 3
done
exec {__sbx_rq}<>"$__sbx_s/req" {__sbx_rp}<>"$__sbx_s/reply" {__sbx_an}<>"$__sbx_s/anchor" || exit 3
__sbx_flock=; command -v flock >/dev/null 2>&1 && __sbx_flock=1
__sbx_setsid=$(command -v setsid)
__sbx_prog=("$1" bash "$__sbx_dir" "$2" "$3" "$4")
__sbx_jb= __sbx_jl= __sbx_jt=
__sbx_n=0
__sbx_restarted='the working directory and exported variables were kept, the rest of the shell state was not'

__sbx_up() {  # the session's anchor runs
  local p t
  IFS=' ' read -r p t 2>/dev/null < "$__sbx_s/session" || return 1
  __sbx_stat "$p" && [ "${__sbx_st[19]}" = "$t" ]
}

__sbx_stop_session() {  # what is left of a session whose anchor is gone or stuck
  local p t
  IFS=' ' read -r p t 2>/dev/null < "$__sbx_s/session" || return 0
  rm -f "$__sbx_s/session"
  case $p in ''|*[!0-9]*) return 0 ;; esac
  __sbx_each "$p"
  [ ${#__sbx_in[@]} -eq 0 ] || kill -KILL "${__sbx_in[@]}" 2>/dev/null
}

__sbx_start() {  # $1 why (kept in STATE/restarts, with the time, for whoever looks into it)
  local i=0
  [ -f "$__sbx_s/session" ] && printf '%s %s\n' "${EPOCHREALTIME%.*}" "$1" >> "$__sbx_s/restarts"
  __sbx_stop_session
  rm -f "$__sbx_s/used"
  while IFS= read -r -t 0 -u "$__sbx_rq"; do IFS= read -r -d '' -u "$__sbx_rq" _ || break; done
  # (As a job: a background command without job control would ignore SIGINT and SIGQUIT,
  # and so would every process of the session.)
  set -m
  $__sbx_setsid bash -c "${__sbx_prog[@]}" 9>&- {__sbx_rq}<&- {__sbx_rp}>&- {__sbx_an}<&- \
    </dev/null >/dev/null 2>&1 &
  set +m
  until __sbx_up; do
    i=$((i + 1)); [ $i -gt 500 ] && return 1
    read -r -t 0.01 -u "$__sbx_an" _
  done
  return 0
}

__sbx_failed() {  # $1 nonce, $2 why
  printf '%s started 0 0 0\nsbx: %s\n%s exited 1\n' "$1" "$2" "$1"
  exec 9>&-
}

__sbx_call() {  # $1 nonce, $2 command: the answer on stdout
  local line b= rc=1 note= i k busy gone
  # The session's own nonce: the command can see it, never the executor's.
  k=${EPOCHREALTIME/./}$RANDOM$RANDOM$BASHPID
  if [ -n "$__sbx_flock" ]; then exec 9>"$__sbx_s/lock"; flock 9; fi
  __sbx_n=$((__sbx_n + 1))
  # Empty output files (silent calls) are cleared now and then: one exec per 200 calls.
  [ $((__sbx_n % 200)) -eq 0 ] && rm -f "$__sbx_dir"/.sbx-out-*
  if ! __sbx_up && ! { read -r -t 0.05 -u "$__sbx_an" _; __sbx_up; }; then  # (a second look)
    [ -f "$__sbx_s/used" ] && note='the sandbox was restarted or its shell was killed'
    __sbx_start "${note:-not started yet}" || { __sbx_failed "$1" 'the session shell did not start'; return; }
  fi
  while IFS= read -r -t 0 -u "$__sbx_rp"; do IFS= read -r -u "$__sbx_rp" _ || break; done
  printf '%s\n%s\0' "$k" "$2" >&"$__sbx_rq"
  # Its start report, within 2 minutes. A shell that is alive is waited for (a loaded
  # machine); one busy for 30 s is still running a call whose relay died unseen, which
  # ends (its backup serves this one); none alive for 10 s means a new shell.
  busy=0 gone=0
  for ((i = 1; i <= 24; i++)); do
    while IFS= read -r -t 5 -u "$__sbx_rp" line; do
      case $line in "$k started "*) b=${line#"$k started "}; break 2 ;; esac
    done
    if IFS= read -r line 2>/dev/null < "$__sbx_dir/.sbx-live" && kill -0 "$line" 2>/dev/null; then
      gone=0 busy=$((busy + 1))
      [ $busy -eq 6 ] && kill -KILL "$line"
      continue
    fi
    gone=$((gone + 1))
    [ $gone -lt 2 ] && continue
    [ -f "$__sbx_s/used" ] && note='its shell stopped answering'
    __sbx_start "${note:-its shell stopped answering}" || break
    gone=0
    printf '%s\n%s\0' "$k" "$2" >&"$__sbx_rq"
  done
  if [ -z "$b" ]; then __sbx_failed "$1" 'the session shell does not answer'; return; fi
  IFS=' ' read -r __sbx_jb __sbx_jl __sbx_jt <<<"$b"
  printf '%s started %s\n' "$1" "$b"
  [ -n "$note" ] && printf '[a new shell: %s; %s]\n' "$note" "$__sbx_restarted"
  b=${b%% *}
  while IFS= read -r -u "$__sbx_rp" line; do
    case $line in
      "$k exited "*) rc=${line#"$k exited "}; break ;;
      "$b ended "*) rc=${line#"$b ended "}; break ;;
    esac
  done
  __sbx_jb=
  line=$__sbx_dir/.sbx-out-$k
  if [ -s "$line" ]; then cat -- "$line"; rm -f -- "$line"; fi
  printf '%s exited %d\n' "$1" "$rc"
  exec 9>&-
}
"""
)

SERVER = _fill(
    _SERVER
    + r"""
# Its executor died (SIGTERM, see runtime enter): the running call's caller is gone, so the
# call is killed, and with it the session's lock.
# (Its three numbers are kept apart: the trap may run inside an ``IFS= read``.)
trap '[ -n "$__sbx_jb" ] && __sbx_kill "$__sbx_jb" "$__sbx_jl" "$__sbx_jt"; exit 143' TERM HUP
printf 'sbx-shell-server 2\n'
while IFS= read -r __sbx_nonce && IFS= read -r -d '' __sbx_cmd; do
  __sbx_call "$__sbx_nonce" "$__sbx_cmd"
done
"""
)

#: How the relay starts: a few bytes of argv (an exec's command line may be short: on
#: Kubernetes it travels in the URL), then its program and its four arguments read from
#: stdin, each ended by a NUL (``BOOT_INPUT``), before the requests.
BOOT = (
    ": sbx-shell-server; IFS= read -r -d '' __sbx_p || exit 3; set --; "
    'for __sbx_i in 1 2 3 4; do IFS= read -r -d \'\' __sbx_a || exit 3; set -- "$@" "$__sbx_a"; done; '
    'unset __sbx_i __sbx_a; eval "$__sbx_p"'
)
BOOT_INPUT = "".join(part + "\0" for part in (SERVER, ANCHOR, LOOP, BACKUP, HOLD)).encode()
