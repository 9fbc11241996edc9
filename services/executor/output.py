"""Bounded capture of command output and its rendering for an LLM reader (pure)."""

from __future__ import annotations

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


def text(data: bytes) -> str:
    """UTF-8 text, or a clear note for binary data (NUL bytes or mostly undecodable)."""
    if not data:
        return ""
    decoded = data.decode("utf-8", errors="replace")
    undecodable = decoded.count("\ufffd") - data.count("\ufffd".encode())
    if b"\x00" in data or undecodable > max(8, len(decoded) // 10):
        return (
            f"[binary output: {len(data)} bytes not shown; "
            "pipe it through `xxd | head` or `base64` to inspect]"
        )
    return decoded


def tail_note(total: int, shown: int) -> str:
    return f"[... showing the last {shown} of {total} bytes ...]\n" if total > shown else ""
