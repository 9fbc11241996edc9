"""Bounded capture of command output and its rendering for an LLM reader (pure)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field


@dataclass
class Capture:
    """Keeps the first and last ``limit/2`` bytes of a stream of any length."""

    limit: int
    head: bytearray = field(default_factory=bytearray)
    tail: bytearray = field(default_factory=bytearray)
    total: int = 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        half = self.limit // 2
        room = half - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            if len(self.tail) > self.limit - half:
                del self.tail[: len(self.tail) - (self.limit - half)]

    @property
    def truncated(self) -> bool:
        return self.total > len(self.head) + len(self.tail)

    def render(self) -> str:
        if not self.truncated:
            return text(bytes(self.head + self.tail))
        dropped = self.total - len(self.head) - len(self.tail)
        return (
            text(bytes(self.head)) + f"\n[... output truncated: {dropped} of {self.total} bytes omitted; "
            "redirect to a file and view parts of it to see everything ...]\n" + text(bytes(self.tail))
        )


_ESCAPED = re.compile("[\udc80-\udcff\x00]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code - 0xDC00 if code else 0:02x}"


def text(data: bytes) -> str:
    """UTF-8 text as it is. Bytes that are not UTF-8, and NULs, are shown as ``\\xNN`` with
    a note saying so (faithful, and nothing a reader could take for text); output that is
    mostly such bytes (a binary file) is replaced by a note on how to look at it."""
    if not data:
        return ""
    decoded = data.decode("utf-8", errors="surrogateescape")  # invalid byte b -> U+DC00+b
    odd = len(_ESCAPED.findall(decoded))
    if not odd:
        return decoded
    if odd > max(8, len(data) // 10):
        return (
            f"[binary output: {len(data)} bytes not shown; "
            "pipe it through `xxd | head` or `base64` to inspect]"
        )
    return _ESCAPED.sub(_escape, decoded) + f"\n[{odd} byte(s) that are not UTF-8 text shown as \\xNN]"


def tail_note(total: int, shown: int) -> str:
    return f"[... showing the last {shown} of {total} bytes ...]\n" if total > shown else ""
