"""The session's bash programs: a timed read never loses the byte it took.

Bash's ``read -t`` that times out returns a status above 128 and still assigns what it
had read: a one-byte read racing its own timer (a loaded machine) has taken the byte and
reports failure. The relay waits for its answers and the session's lock token so; a lost
first byte garbled the answer line, and the relay then took a healthy shell for wedged.
"""

from __future__ import annotations

import re
import subprocess

from services.executor import bashsession

# A one-byte timed read: ``read -r -N 1 -t SECONDS -u FD VAR``.
TIMED = re.compile(r"read -r -N 1 -t \S+ -u \"\$(__sbx_\w+)\" (\w+)")


def test_the_premise_a_timed_read_that_fails_may_have_taken_the_byte() -> None:
    """Bash itself, run many times against a writer: some timed-out reads hold a byte."""
    script = r"""
    exec 3< <(for ((i = 0; i < 20000; i++)); do printf a; done; printf Z)
    n=0 saved=0
    while :; do
      c=
      if read -r -N 1 -t 0.00001 -u 3 c; then
        [[ $c == Z ]] && break; n=$((n + 1))
      elif [[ -n $c ]]; then
        [[ $c == Z ]] && break; n=$((n + 1)) saved=$((saved + 1))
      fi
    done
    echo "$n $saved"
    """
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60, check=True)
    received, _saved = map(int, out.stdout.split())
    # Every byte is received when a failed read's variable is looked at (``saved`` counts
    # those: how many depends on the machine, so it is not asserted).
    assert received == 20000


def test_every_timed_one_byte_read_of_an_answer_or_the_token_keeps_what_it_took() -> None:
    """The reply FIFO and the lock token are read a byte at a time with a timeout; each
    such read is followed by a look at its variable (``|| [ -n "$VAR" ]``)."""
    programs = bashsession.SERVER
    reads = [(m.group(1), m.group(2), programs[m.end() : m.end() + 40]) for m in TIMED.finditer(programs)]
    consumed = [(fd, var, rest) for fd, var, rest in reads if fd in ("__sbx_rp", "__sbx_tk")]
    assert {fd for fd, _, _ in consumed} == {"__sbx_rp", "__sbx_tk"}
    for fd, var, rest in consumed:
        assert var != "_", f"a timed read of {fd} throws its byte away"
        assert rest.startswith(f' || [ -n "${var}" ]'), f"a timed read of {fd} into {var} is not checked"
