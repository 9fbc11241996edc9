"""Text for a terminal that someone else wrote: a sandbox (command text, paths, output
names), a tenant (ids, labels) or a registry (error reasons). One rule for every line
``sbx`` and ``sbx-host`` print.

Shown visibly instead of sent raw: C0 controls (ESC, CR, LF, TAB, BEL, backspace...), DEL,
C1 controls (U+0080-U+009F: ``\\x9b`` is a CSI in some terminals), line and paragraph
separators, and format characters, the bidi overrides and isolates among them (U+202E
reverses what follows). ``\\n``, ``\\r`` and ``\\t`` appear as such, the rest as
``\\xNN``, ``\\uNNNN`` or ``\\UNNNNNNNN``. A backslash stays as it is: a command's own
``\\n`` reads the same as an escaped line feed, which can mislead a reader but never the
terminal.
"""

from __future__ import annotations

import json
import re
import unicodedata
from typing import Any

_UNSAFE_CATEGORIES = frozenset(("Cc", "Cf", "Zl", "Zp", "Cs"))
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
_CANDIDATE = re.compile(r"[^\x20-\x7e]")  # printable ASCII is always safe: only the rest is looked at


def _shown(char: str) -> str:
    if unicodedata.category(char) not in _UNSAFE_CATEGORIES:
        return char
    if char in _NAMED:
        return _NAMED[char]
    point = ord(char)
    return f"\\x{point:02x}" if point < 0x100 else f"\\u{point:04x}" if point < 0x10000 else f"\\U{point:08x}"


def escape(text: str) -> str:
    """``text`` with every character that could move the cursor, rewrite the screen, start
    a new line or reorder what follows shown as an escape."""
    return _CANDIDATE.sub(lambda match: _shown(match.group()), text)


def json_text(value: Any, *, indent: int | None = None) -> str:
    """JSON that is safe on a terminal: plain ASCII (every control and non-ASCII character
    as a ``\\u`` escape, DEL too), the same value for a program that parses it."""
    return json.dumps(value, ensure_ascii=True, indent=indent).replace("\x7f", "\\u007f")


def json_line(value: Any) -> str:
    """One JSON object a line (NDJSON)."""
    return json_text(value)
