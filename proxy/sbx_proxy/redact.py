"""Keeping secrets out of what goes back to the sandbox (pure).

Secrets are masked with the same number of ``*`` so message framing (Content-Length)
stays valid while bodies stream; a secret split across two chunks is still found.
"""

from __future__ import annotations

from collections.abc import Iterable


class Redactor:
    """A mitmproxy stream function: call with each chunk, then with b"" at the end."""

    def __init__(self, secrets: Iterable[str]) -> None:
        self.secrets = sorted({s.encode() for s in secrets if s}, key=len, reverse=True)
        self.keep = max((len(s) for s in self.secrets), default=1) - 1
        self.pending = b""
        self.hits = 0

    def mask(self, data: bytes) -> tuple[bytes, int]:
        """``data`` with every whole secret masked, and where unmasked text may still end
        in the start of a secret (everything before that offset is final)."""
        out = bytearray()
        i = 0
        while True:
            found = [(data.find(s, i), s) for s in self.secrets]
            found = [(at, s) for at, s in found if at >= 0]
            if not found:
                break
            at, secret = min(found, key=lambda f: (f[0], -len(f[1])))
            out += data[i:at] + b"*" * len(secret)
            i = at + len(secret)
            self.hits += 1
        out += data[i:]
        return bytes(out), max(len(out) - self.keep, len(out) - (len(data) - i))

    def __call__(self, chunk: bytes) -> bytes:
        if not self.secrets:
            return chunk
        data = self.pending + chunk
        masked, final = self.mask(data)
        if not chunk:  # end of the stream: nothing more can complete a secret
            self.pending = b""
            return masked
        self.pending = masked[final:]
        return masked[:final]


def text(value: str, secrets: Iterable[str]) -> str:
    for secret in sorted((s for s in secrets if s), key=len, reverse=True):
        value = value.replace(secret, "*" * len(secret))
    return value
