"""The session's bash: one live bash per sandbox, owned by the sandbox, that runs every
``shell`` call of the session, so all of bash's state carries over between calls.

Each call's text is written to a file (``SCRIPT``) that the session's bash sources at its
own top level, as a script: bash's own rules apply to it. An error aborts only the
command it occurs in (never the rest of the call, never a roll-back); ``$LINENO`` and
error messages count from the call's first line; ``continue``/``break`` outside a loop
are the errors they are in a script; ``$$`` is the process running the code (signals
sent to it reach the agent's traps) and ``$BASH_SUBSHELL`` is 0. The command's stdout
and stderr are a pipe (reopening ``/dev/stdout`` cannot truncate what was said before),
read by a ``cat`` of the relay's into a file of the call's own; stdin is ``/dev/null``.

Processes, all inside the sandbox:

- **R**, the anchor, started by the first relay under ``setsid``: it restores the cwd and
  exports last saved (an older session's, or what the ``sh`` path saved), starts B and
  waits for it, then only lives (its pid and start time name the session).
- **B**, the server: a fresh bash (never a subshell) whose script is a FIFO
  (``STATE/ctl``) of one line per call, written by B itself: read the request, source
  the call's script with the call's output pipe, answer. No loop of ours surrounds the
  agent's code, and the user's shell options stay as the user left them. After each call
  B checks its own files (a command may have closed or moved them: ``exec {__sbx_rp}>&-``,
  ``exec 10>f; exec 10>&-``) and opens again those that are not what they were.
- **C**, the backup: before each call B forks a copy of itself, which blocks on a FIFO
  that only B holds open for writing. If B ends during a call (``exit``, ``set -e``, a
  timeout's kill, ``exec``), C sees end of file and takes B's place with the state from
  before that call: it writes that state as bash code (variables, functions, aliases,
  options, traps, positional parameters, directory stack) and starts a fresh B that
  sources it, whose waiter it becomes. Background jobs of the old B are no longer jobs
  of the new one, and ``$$`` is the new B's. Otherwise B kills C when the next copy is made.
  An end of file while B still has its program open is a command closing B's end of the
  FIFO, not B's end: C leaves, and B opens a new end for the next copy.
- **W**, B's waiter (R for the first B, then the C that took over): reports how B ended,
  with its exact status.

The **relay** (``SERVER``) is the executor's end: one per executor and sandbox, started
through the runtime's exec. It takes the session's lock (a token in a FIFO, see
``__sbx_lock``), starts the session if none runs,
writes the call's script, keeps the output pipe's reader ready, passes requests and
answers, and reads each call's output file. It holds no state, so an executor killed
between two calls loses nothing, and a call can land on any executor.

The answers come from inside the sandbox and are untrusted (see ``shells``).
"""

from __future__ import annotations

from shared.runtime import api

STATE = "/.sbx/shell"
OUTPUT_DIR = api.OUTPUT_DIR
SCRIPT = "command"
"""The file (in the output directory) a call's text is sourced from: error messages name it."""
HELLO = b"sbx-shell-server 3\n"
VERSION = "6"
"""Of the session's programs: a session started by other ones is replaced (not talked to)."""
PREPARE = ": sbx-prepare"
"""The warm-up call of a pool sandbox's shell: answered, not run, not a user's call."""
TRAILER = "{ __sbx_rc=$?; } >/dev/null 2>&1"
"""Appended to a call's script (after an empty line) unless it has a here-document: keeps
the last command's status and ends the script with 0, so that a last command exempt from
``set -e`` (``[ -f x ] && y``) does not end the shell when the script returns."""


def _fill(text: str) -> str:
    return text.replace("@S@", STATE).replace("@OUT@", OUTPUT_DIR).replace("@V@", VERSION)


# Code of the session's processes. It runs amid the user's state and under the user's
# options (errexit, nounset, xtrace, noclobber...): builtins are called as ``\builtin``
# (no alias, no function of ours), every command that may fail is tested, no glob, no
# unset variable, ``>|`` for files. B's own stdout and stderr are /dev/null between calls.

#: B, once: its control variables stay out of its children's environment; the first
#: backup and the first call's line.
_INIT = r"""
\builtin export -n __sbx_dir __sbx_bash __sbx_rq __sbx_rp __sbx_cw __sbx_init __sbx_a __sbx_b \
  __sbx_next __sbx_backup __sbx_hold __sbx_state __sbx_sf
BASH_ARGV0=bash
if [[ -n ${__sbx_sf-} ]]; then \command rm -f -- "$__sbx_sf" 2>/dev/null || :; fi
__sbx_line='\builtin eval "$__sbx_a"; \builtin . "$__sbx_dir/@SCRIPT@" {__sbx_rq}<&- {__sbx_rp}>&- '
__sbx_line+='{__sbx_w}>&- {__sbx_cw}>&- >&"$__sbx_of" 2>&1 </dev/null {__sbx_of}>&-'
# (The answer on a line of its own: an error that makes bash discard the rest of the
# line it is running, as an arithmetic error in an array subscript does, leaves it.)
__sbx_line+=$'\n\\builtin eval "$__sbx_b"'
__sbx_w= __sbx_c= __sbx_c0= __sbx_used= __sbx_pw= __sbx_of= __sbx_sf= __sbx_al=${__sbx_al-1}
__sbx_fix='[[ /proc/self/fd/$__sbx_rq -ef @S@/req ]] || \command exec {__sbx_rq}<>@S@/req
[[ /proc/self/fd/$__sbx_rp -ef @S@/reply ]] || \command exec {__sbx_rp}<>@S@/reply
[[ /proc/self/fd/$__sbx_cw -ef @S@/ctl ]] || \command exec {__sbx_cw}<>@S@/ctl'
\builtin shopt -u expand_aliases
\builtin eval "$__sbx_next"
"""

#: B, between calls: a copy of this state (double fork: $! stays the user's), the one
#: before ended, and the next call's line on B's input.
_NEXT = r"""
__sbx_n=$(\builtin set -m
  ( \builtin eval "$__sbx_backup" ) </dev/null >/dev/null 2>&1 &
  \builtin printf '%s' "$!")
if [[ -z $__sbx_w || ! /proc/self/fd/$__sbx_w -ef @S@/alive ]]; then \command exec {__sbx_w}>"@S@/alive"; fi
if [[ -n $__sbx_c0 ]]; then \builtin kill -KILL "$__sbx_c0" 2>/dev/null || :; fi
if [[ -n $__sbx_c ]]; then \builtin kill -USR1 "$__sbx_c" 2>/dev/null || :; fi
__sbx_c0=$__sbx_c __sbx_c=$__sbx_n __sbx_pw=${PWD-}
\builtin printf '%s\n' "$__sbx_line" >&"$__sbx_cw"
"""

#: B, before a call: the request (``<nonce> <output FIFO> <p: the pool's warm-up | ->``),
#: the start report, the output pipe.
_A = r"""
until IFS=' ' TMOUT= \builtin read -r -u "$__sbx_rq" __sbx_k __sbx_ff __sbx_p; do
  [[ $? -gt 128 ]] || \builtin exit 1  # (its request fd is gone: the backup serves)
done
__sbx_rc=
IFS=' ' \builtin read -r __sbx_t _ </proc/uptime || __sbx_t=0.00
IFS=' ' \builtin read -r _ _ _ _ __sbx_l </proc/loadavg || __sbx_l=0
\builtin printf '%s started %s %s %s\n' "$__sbx_k" "$BASHPID" "$__sbx_l" "${__sbx_t/./}" >&"$__sbx_rp"
\command exec {__sbx_of}>|"$__sbx_ff"
if [[ -n ${PWD-} && ! -d ${PWD-} ]]; then
  \builtin printf '[the working directory %s no longer exists; now in /workspace]\n' "$PWD" >&"$__sbx_of"
  \builtin cd /workspace 2>/dev/null || \builtin cd / || :
fi
if [[ $__sbx_p != p && -z $__sbx_used ]]; then
  __sbx_used=1
  : >| "@S@/used"  # a user's call ran in this shell: losing it loses state
fi
if [[ $__sbx_al = 1 ]]; then \builtin shopt -s expand_aliases; fi
"""

#: B, after a call ($? is the script's status, unless its trailer kept the last command's);
#: a new working directory and the exports are saved before the answer (a new session, an
#: async job and a snapshot taken after the answer start from them).
_B = r"""
__sbx_rc=${__sbx_rc:-$?} __sbx_al=0
[[ /proc/self/fd/$__sbx_rp -ef @S@/reply && /proc/self/fd/$__sbx_rq -ef @S@/req &&
  /proc/self/fd/$__sbx_cw -ef @S@/ctl ]] || \builtin eval "$__sbx_fix"
\builtin shopt -q expand_aliases && __sbx_al=1
\builtin shopt -u expand_aliases
\command exec {__sbx_of}>&-
if [[ ${PWD-} != "$__sbx_pw" ]]; then \builtin printf '%s\n' "$PWD" >| @S@/cwd 2>/dev/null || :; fi
\builtin export -p >| @S@/env 2>/dev/null || :
\builtin printf '%s exited %d\n' "$__sbx_k" "$__sbx_rc" >&"$__sbx_rp"
\builtin eval "$__sbx_next"
"""

#: C: holds B's state from before the running call; takes B's place if B ends in it.
#: (The exports are saved by B before each answer: async jobs start from them, and so do
#: a new session and a sandbox from a snapshot taken after the answer.) A USR1 from B (a
#: newer copy exists) ends it.
_BACKUP = r"""
__sbx_so=${SHELLOPTS-} __sbx_tf=$__sbx_dir/.sbx-traps __sbx_tp=
\builtin trap -p >| "$__sbx_tf" 2>/dev/null
IFS= \builtin read -r -d '' __sbx_tp <"$__sbx_tf" 2>/dev/null
\builtin set +euvxfC +o pipefail +o posix
\builtin trap '__sbx_q=1' USR1
if [[ -n $__sbx_w ]]; then \command exec {__sbx_w}>&-; fi
[[ -n ${__sbx_q-} ]] && \builtin exit 0
\builtin trap '\builtin exit 0' USR1
\command exec {__sbx_m}<@S@/alive
until IFS= TMOUT= \builtin read -r -u "$__sbx_m" __sbx_x; [[ $? -eq 1 ]]; do :; done
\command exec {__sbx_m}<&-
for __sbx_x in /proc/$$/fd/*; do [[ $__sbx_x -ef @S@/ctl ]] && \builtin exit 0; done
\builtin trap - USR1
\builtin eval "$__sbx_state"
__sbx_boot='\builtin . "$__sbx_sf"; \builtin eval "$__sbx_init"'
\builtin eval "$__sbx_hold"
\builtin exit 0
"""

#: C taking over: the state it holds (B's before the call that ended it) as bash code in
#: ``$__sbx_sf``, for the new B to source. Umask, limits, cwd, exports and open files pass
#: through the exec.
_STATE = r"""
__sbx_sf=$__sbx_dir/.sbx-state-$BASHPID
{
  IFS=$'\n' \builtin read -r -d '' -a __sbx_vs < <(\builtin compgen -v)
  for __sbx_v in "${__sbx_vs[@]}"; do
    case $__sbx_v in
      __sbx_*|BASH|BASHOPTS|BASHPID|BASH_ALIASES|BASH_ARGC|BASH_ARGV|BASH_ARGV0|BASH_CMDS|BASH_COMMAND) ;;
      BASH_EXECUTION_STRING|BASH_LINENO|BASH_REMATCH|BASH_SOURCE|BASH_SUBSHELL|BASH_VERSINFO|BASH_VERSION) ;;
      COMP_WORDBREAKS|DIRSTACK|EPOCHREALTIME|EPOCHSECONDS|EUID|FUNCNAME|GROUPS|HISTCMD|LINENO) ;;
      PIPESTATUS|PPID|RANDOM|SECONDS|SHELLOPTS|SRANDOM|UID|_) ;;
      *) \builtin declare -p -- "$__sbx_v" ;;
    esac
  done
  \builtin shopt -p
  \builtin declare -f
  \builtin declare -F
  \builtin alias -p
  \builtin printf '%s\n' "$__sbx_tp"
  \builtin printf 'set --'
  \builtin printf ' %q' "$@"
  \builtin printf '\n'
  for ((__sbx_i = ${#DIRSTACK[@]} - 1; __sbx_i > 0; __sbx_i--)); do
    __sbx_d=${DIRSTACK[__sbx_i]}
    [[ $__sbx_d = '~'* ]] && __sbx_d=$HOME${__sbx_d:1}
    \builtin printf '\\builtin pushd -n -- %q >/dev/null\n' "$__sbx_d"
  done
  \builtin printf '__sbx_al=%q\n' "$__sbx_al"
  for __sbx_o in braceexpand hashall interactive-comments; do
    [[ :$__sbx_so: = *:$__sbx_o:* ]] || \builtin printf 'set +o %s\n' "$__sbx_o"
  done
  IFS=: \builtin read -r -a __sbx_vs <<<"$__sbx_so"
  for __sbx_o in "${__sbx_vs[@]}"; do
    [[ $__sbx_o = monitor ]] || \builtin printf 'set -o %s\n' "$__sbx_o"
  done
} >| "$__sbx_sf" 2>/dev/null
"""

#: W: starts a fresh B (its first line: ``$__sbx_boot``) and reports how it ended.
_HOLD = r"""
\builtin set -m
while IFS= \builtin read -r -t 0 -u "$__sbx_cw"; do IFS= \builtin read -r -t 1 -u "$__sbx_cw" _ || break; done
\builtin printf '%s\n' "$__sbx_boot" >&"$__sbx_cw"
BASH_ENV= ENV= __sbx_dir=$__sbx_dir __sbx_bash=$__sbx_bash __sbx_rq=$__sbx_rq __sbx_rp=$__sbx_rp \
  __sbx_cw=$__sbx_cw __sbx_init=$__sbx_init __sbx_a=$__sbx_a __sbx_b=$__sbx_b __sbx_next=$__sbx_next \
  __sbx_backup=$__sbx_backup __sbx_hold=$__sbx_hold __sbx_state=$__sbx_state __sbx_sf=${__sbx_sf-} \
  "$__sbx_bash" @S@/ctl </dev/null >/dev/null 2>&1 &
__sbx_b=$!
\builtin printf '%s\n' "$__sbx_b" >| "$__sbx_dir/.sbx-live" 2>/dev/null
while :; do
  \builtin wait "$__sbx_b"
  \builtin kill -0 "$__sbx_b" 2>/dev/null || break
done
\builtin wait "$__sbx_b"
__sbx_rc=$?
\builtin printf '%s ended %d\n' "$__sbx_b" "$__sbx_rc" >&"$__sbx_rp"
"""

#: R: $1 the output directory, $2 bash's path; $3- the programs above.
_ANCHOR = r"""
command exec </dev/null >/dev/null 2>&1
__sbx_dir=$1 __sbx_bash=$2 __sbx_init=$3 __sbx_a=$4 __sbx_b=$5 __sbx_next=$6
__sbx_backup=$7 __sbx_state=$8 __sbx_hold=$9
builtin set --
command exec {__sbx_rq}<>@S@/req {__sbx_rp}<>@S@/reply {__sbx_an}<>@S@/anchor \
  {__sbx_cw}<>@S@/ctl || builtin exit 3
builtin cd -- "${SBX_WORKDIR:-/workspace}" 2>/dev/null || builtin cd /workspace 2>/dev/null || builtin cd /
if [ -f @S@/cwd ]; then IFS= builtin read -r __sbx_d < @S@/cwd && builtin cd -- "$__sbx_d" 2>/dev/null; fi
if [ -f @S@/env ]; then . @S@/env; fi
builtin unset __sbx_d
IFS= builtin read -r __sbx_st < /proc/self/stat
__sbx_st=${__sbx_st##*) }
builtin set -f
builtin set -- $__sbx_st
builtin set +f
builtin printf '%s %s @V@\n' "$BASHPID" "${20}" >| @S@/session
builtin set --
builtin unset __sbx_st
__sbx_boot='\builtin eval "$__sbx_init"'
builtin eval "$__sbx_hold"
while :; do IFS= builtin read -r -u "$__sbx_an" _; done
"""

INIT = _fill(_INIT).replace("@SCRIPT@", SCRIPT)
A = _fill(_A)
B = _fill(_B)
NEXT = _fill(_NEXT)
BACKUP = _fill(_BACKUP)
STATE_CODE = _fill(_STATE)
HOLD = _fill(_HOLD)
ANCHOR = _fill(_ANCHOR)

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

#: The relay: $1 R's program, $2- B's (see ``BOOT``). Reads requests ``<nonce>\n<command>\0``;
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
# The FIFOs missing (all six in a new sandbox) are made by one mkfifo, the token's by one
# of its own: whoever makes it makes the lock's token, so it must know it made it.
__sbx_new= __sbx_mk=()
for __sbx_f in req reply anchor alive ctl token; do
  __sbx_f=$__sbx_s/$__sbx_f
  [ -p "$__sbx_f" ] && continue
  [[ -e $__sbx_f || -L $__sbx_f ]] && rm -f "$__sbx_f"
  [ "${__sbx_f##*/}" = token ] || __sbx_mk+=("$__sbx_f")
done
[ ${#__sbx_mk[@]} -eq 0 ] || mkfifo -m 600 "${__sbx_mk[@]}"
for __sbx_f in "${__sbx_mk[@]}"; do [ -p "$__sbx_f" ] || exit 3; done
if [ ! -p "$__sbx_s/token" ]; then
  if mkfifo -m 600 "$__sbx_s/token"; then __sbx_new=1; else [ -p "$__sbx_s/token" ] || exit 3; fi
fi
unset __sbx_mk
exec {__sbx_rq}<>"$__sbx_s/req" {__sbx_rp}<>"$__sbx_s/reply" {__sbx_an}<>"$__sbx_s/anchor" \
  {__sbx_tk}<>"$__sbx_s/token" || exit 3
[ -n "$__sbx_new" ] && printf x >&"$__sbx_tk"  # (the session's first relay makes its lock's token)
__sbx_flock=; command -v flock >/dev/null 2>&1 && __sbx_flock=1
__sbx_held=
# Paths looked up without a subshell (a fork each).
__sbx_setsid= __sbx_bash=$BASH
hash setsid 2>/dev/null && __sbx_setsid=${BASH_CMDS[setsid]-}
hash bash 2>/dev/null && __sbx_bash=${BASH_CMDS[bash]-$BASH}
__sbx_prog=("$1" bash "$__sbx_dir" "$__sbx_bash" "${@:2}")
__sbx_jb= __sbx_jl= __sbx_jt=
__sbx_n=0
__sbx_ff= __sbx_sd= __sbx_sp= __sbx_so= __sbx_sn=0
__sbx_restarted='the working directory and exported variables were kept, the rest of the shell state was not'

__sbx_up() {  # the session's anchor runs, with these programs
  local p t v
  IFS=' ' read -r p t v 2>/dev/null < "$__sbx_s/session" || return 1
  [ "$v" = @V@ ] && __sbx_stat "$p" && [ "${__sbx_st[19]}" = "$t" ]
}

__sbx_stop_session() {  # what is left of a session whose anchor is gone, stuck or older
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
  [[ -e $__sbx_s/used || -L $__sbx_s/used ]] && rm -f "$__sbx_s/used"
  while read -r -t 0 -u "$__sbx_rq"; do read -r -t 1 -u "$__sbx_rq" _ || break; done
  # (As a job: a background command without job control would ignore SIGINT and SIGQUIT,
  # and so would every process of the session.)
  set -m
  $__sbx_setsid bash -c "${__sbx_prog[@]}" 9>&- {__sbx_rq}<&- {__sbx_rp}>&- {__sbx_an}<&- {__sbx_tk}<&- \
    </dev/null >/dev/null 2>&1 &
  set +m
  until __sbx_up; do
    i=$((i + 1)); [ $i -gt 500 ] && return 1
    read -r -t 0.01 -u "$__sbx_an" _
  done
  return 0
}

__sbx_sink() {  # the reader of the next call's output pipe: a cat from a FIFO into a file
  [ -n "$__sbx_sd" ] && return 0
  __sbx_sn=$((__sbx_sn + 1))
  if [ -z "$__sbx_ff" ]; then
    __sbx_ff=$__sbx_s/out-$BASHPID-$__sbx_sn
    [[ -e $__sbx_ff || -L $__sbx_ff ]] && rm -f "$__sbx_ff"
    mkfifo -m 600 "$__sbx_ff" || { __sbx_ff=; return 1; }
  fi
  __sbx_so=$__sbx_dir/.sbx-out-$BASHPID-$__sbx_sn
  # Its fd 3 tells when it ends (end of file on __sbx_sd): all writers closed the pipe.
  exec {__sbx_sd}< <(exec 3>&1 cat -- "$__sbx_ff" >>"$__sbx_so" </dev/null \
    9>&- {__sbx_rq}<&- {__sbx_rp}>&- {__sbx_an}<&- {__sbx_tk}<&-)
  __sbx_sp=$!
}

__sbx_sink_end() {  # the call's output is all in its file: $1 looks, 2 ms apart, or
  local i line     # "unused" (the call never started: its reader, waiting for ever, ends)
  [ -n "$__sbx_sd" ] || return 0
  if [ "$1" = unused ]; then
    kill -KILL "$__sbx_sp" 2>/dev/null
  else
    for ((i = 0; i < $1; i++)); do
      # End of file: every writer closed the pipe and the reader wrote all and ended.
      read -r -t 0.002 -u "$__sbx_sd" _
      if [ $? -eq 1 ]; then exec {__sbx_sd}<&-; __sbx_sd=; return 0; fi
      # Still open (what the call left running has it) yet its reader sleeps: the pipe is
      # empty, so all the call wrote is in the file; later output goes nowhere.
      IFS= read -r line 2>/dev/null < "/proc/$__sbx_sp/stat" || break
      line=${line##*) }
      [ "${line%% *}" = S ] && break
    done
  fi
  rm -f -- "$__sbx_ff"  # (given up: still open, or a late writer would find it)
  exec {__sbx_sd}<&-
  __sbx_ff= __sbx_sd=
}

# The session's lock: one byte in the FIFO STATE/token. Whoever reads it holds the lock
# (its pid and start time in STATE/holder) and writes it back to release it: no process
# per call. A token lost with a holder that was killed (or with the sandbox's processes:
# a FIFO keeps no byte that nobody has open) is made anew, once, under flock.
__sbx_holder() {  # the last holder of the token runs
  local p t
  IFS=' ' read -r p t 2>/dev/null < "$__sbx_s/holder" || return 1
  __sbx_stat "$p" && [ "${__sbx_st[19]}" = "$t" ]
}

__sbx_lock() {
  local t
  # (A ``read -t`` that times out may still have taken the byte: it is then in t.)
  until t=; read -r -N 1 -t 1 -u "$__sbx_tk" t || [ -n "$t" ]; do
    __sbx_holder || __sbx_renew
  done
  printf '%s\n' "$__sbx_me" >| "$__sbx_s/holder"
  __sbx_held=1
}

__sbx_unlock() {
  [ -n "$__sbx_held" ] && printf x >&"$__sbx_tk"
  __sbx_held=
}

__sbx_renew() {  # a token, unless there is one or its holder lives (a holder names itself
  # at once after taking it: a second look after a while)
  [ -n "$__sbx_flock" ] && { exec 9>"$__sbx_s/lock"; flock 9; }
  read -r -t 0.05 -u "$__sbx_an" _
  if ! __sbx_holder && ! read -r -t 0 -u "$__sbx_tk"; then
    printf x >&"$__sbx_tk"
    : >| "$__sbx_s/holder"
  fi
  exec 9>&-
}

__sbx_wedge_note='a new shell: this one could no longer run commands (set -n, enable -n, a function '
__sbx_wedge_note+='named builtin or command, or its __sbx_ variables changed); it has the state from before '
__sbx_wedge_note+='the call that did it'

__sbx_wedged() {  # $1 B: blocked reading its program's FIFO or the requests, no answer pending
  local sc fd _
  read -r sc fd _ 2>/dev/null < "/proc/$1/syscall" || return 1
  case $sc in 0|63) ;; *) return 1 ;; esac  # read(2): x86_64, arm64
  case $fd in 0x[0-9a-f]*) ;; *) return 1 ;; esac
  fd=$((fd))
  [[ /proc/$1/fd/$fd -ef $__sbx_s/ctl || /proc/$1/fd/$fd -ef $__sbx_s/req ]] || return 1
  ! read -r -t 0 -u "$__sbx_rp"
}

__sbx_failed() {  # $1 nonce, $2 why
  printf '%s started 0 0 0\nsbx: %s\n%s exited 1\n' "$1" "$2" "$1"
  __sbx_unlock
}

__sbx_call() {  # $1 nonce, $2 command: the answer on stdout
  local line rest b= rc=1 note= i k busy gone flag=- text stuck wedged
  # The session's own nonce: the command can see it, never the executor's.
  k=${EPOCHREALTIME/./}$RANDOM$RANDOM$BASHPID
  __sbx_lock
  __sbx_n=$((__sbx_n + 1))
  if ! __sbx_up && ! { read -r -t 0.05 -u "$__sbx_an" _; __sbx_up; }; then  # (a second look)
    [ -f "$__sbx_s/used" ] && note='the sandbox was restarted or its shell was killed'
    __sbx_start "${note:-not started yet}" || { __sbx_failed "$1" 'the session shell did not start'; return; }
  fi
  __sbx_sink || { __sbx_failed "$1" 'the output pipe could not be made'; return; }
  # The call's text is the script the session's bash sources.
  text=${2//<<</}
  if [ "$2" = '@PREPARE@' ]; then
    flag=p; : >| "$__sbx_dir/@SCRIPT@"
  elif [[ $text = *'<<'* ]]; then
    printf '%s' "$2" >| "$__sbx_dir/@SCRIPT@"
  else
    printf '%s\n\n%s\n' "$2" '@TRAILER@' >| "$__sbx_dir/@SCRIPT@"
  fi || { __sbx_failed "$1" 'the command could not be written'; return; }
  while IFS= read -r -t 0 -u "$__sbx_rp"; do IFS= read -r -t 1 -u "$__sbx_rp" _ || break; done
  printf '%s %s %s\n' "$k" "$__sbx_ff" "$flag" >&"$__sbx_rq"
  # Its start report, within 2 minutes. A shell that is alive is waited for (a loaded
  # machine); one busy for 30 s is still running a call whose relay died unseen, which
  # ends (its backup serves this one); none alive for 10 s means a new shell.
  busy=0 gone=0
  for ((i = 1; i <= 24; i++)); do
    # (Only a line's first byte is waited for with a timeout: ``read -t`` polls before
    # each byte, and a line is written at once. A read that times out may still have
    # taken that byte: it is then in line, and the answer is not lost.)
    while { line=; read -r -N 1 -t 5 -u "$__sbx_rp" line || [ -n "$line" ]; } &&
      IFS= read -r -u "$__sbx_rp" rest; do
      line+=$rest
      case $line in "$k started "*) b=${line#"$k started "}; break 2 ;; esac
    done
    if IFS= read -r line 2>/dev/null < "$__sbx_dir/.sbx-live" && kill -0 "$line" 2>/dev/null; then
      # (wedged by the call before: its backup, which has the state from before it, serves)
      if [ -z "$wedged" ] && __sbx_wedged "$line"; then wedged=1; kill -KILL "$line"; continue; fi
      gone=0 busy=$((busy + 1))
      [ $busy -eq 6 ] && kill -KILL "$line"
      continue
    fi
    gone=$((gone + 1))
    [ $gone -lt 2 ] && continue
    [ -f "$__sbx_s/used" ] && note='its shell stopped answering'
    __sbx_start "${note:-its shell stopped answering}" || break
    gone=0
    printf '%s %s %s\n' "$k" "$__sbx_ff" "$flag" >&"$__sbx_rq"
  done
  if [ -z "$b" ]; then
    __sbx_sink_end unused
    __sbx_failed "$1" 'the session shell does not answer'
    return
  fi
  IFS=' ' read -r __sbx_jb __sbx_jl __sbx_jt <<<"$b"
  printf '%s started %s\n' "$1" "$b"
  [ -n "$note" ] && printf '[a new shell: %s; %s]\n' "$note" "$__sbx_restarted"
  b=${b%% *}
  stuck=0
  while :; do
    if { line=; read -r -N 1 -t 1 -u "$__sbx_rp" line || [ -n "$line" ]; } &&
      IFS= read -r -u "$__sbx_rp" rest; then
      line+=$rest
      case $line in
        "$k exited "*) rc=${line#"$k exited "}; break ;;
        "$b ended "*) rc=${line#"$b ended "}; break ;;
      esac
      continue
    fi
    # A second without an answer: B waiting for a line of its own program that it will
    # never write (``set -n``, a builtin it uses disabled, one of its variables changed)
    # is wedged, seen twice in a row: it is killed and its backup takes over.
    if __sbx_wedged "$b"; then
      stuck=$((stuck + 1))
      [ $stuck -ge 2 ] && { wedged=1; kill -KILL "$b" 2>/dev/null; }
    else
      stuck=0
    fi
  done
  __sbx_jb=
  __sbx_sink_end 500
  if [ -s "$__sbx_so" ]; then cat -- "$__sbx_so"; rm -f -- "$__sbx_so"; fi
  [ -n "$wedged" ] && printf '\n[%s]\n' "$__sbx_wedge_note"
  printf '%s exited %d\n' "$1" "$rc"
  __sbx_unlock
  # Empty output files (silent calls) are cleared now and then: one exec per 200 calls.
  [ $((__sbx_n % 200)) -eq 0 ] && rm -f "$__sbx_dir"/.sbx-out-*
  __sbx_sink
}

__sbx_quit() {  # $1 the exit status; the reader made for the next call ends too
  [ -n "$__sbx_sd" ] && kill -KILL "$__sbx_sp" 2>/dev/null
  exit "$1"
}
"""
)

SERVER = (
    _fill(
        _SERVER
        + r"""
# Its executor died (SIGTERM, see runtime enter): the running call's caller is gone, so the
# call is killed, and with it the session's lock.
# (Its three numbers are kept apart: the trap may run inside an ``IFS= read``.)
trap '[ -n "$__sbx_jb" ] && __sbx_kill "$__sbx_jb" "$__sbx_jl" "$__sbx_jt"
  __sbx_unlock; __sbx_quit 143' TERM HUP
__sbx_stat "$BASHPID" && __sbx_me="$BASHPID ${__sbx_st[19]}"
[ -n "$__sbx_new" ] || __sbx_holder || __sbx_renew  # (a sandbox restarted: no token)
printf 'sbx-shell-server 3\n'
while IFS= read -r __sbx_nonce && IFS= read -r -d '' __sbx_cmd; do
  __sbx_call "$__sbx_nonce" "$__sbx_cmd"
done
__sbx_quit 0
"""
    )
    .replace("@SCRIPT@", SCRIPT)
    .replace("@PREPARE@", PREPARE)
    .replace("@TRAILER@", TRAILER)
)

#: How the relay starts: a few bytes of argv (an exec's command line may be short: on
#: Kubernetes it travels in the URL), then its program and R's and B's, read from stdin,
#: each ended by a NUL (``BOOT_INPUT``), before the requests.
BOOT = (
    ": sbx-shell-server; IFS= read -r -d '' __sbx_p || exit 3; set --; "
    "for __sbx_i in 1 2 3 4 5 6 7 8; do IFS= read -r -d '' __sbx_a || exit 3; "
    'set -- "$@" "$__sbx_a"; done; '
    'unset __sbx_i __sbx_a; eval "$__sbx_p"'
)
BOOT_INPUT = "".join(
    part + "\0" for part in (SERVER, ANCHOR, INIT, A, B, NEXT, BACKUP, STATE_CODE, HOLD)
).encode()
