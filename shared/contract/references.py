"""Image references: what a user may name an image by, parsed and normalised.

The grammar is the one of the distribution project (``docker pull`` and every OCI
registry client use it)::

    reference  := name [ ":" tag ] [ "@" digest ]
    name       := [ domain "/" ] component ( "/" component )*
    domain     := host [ ":" port ]      (the first part, if it has a "." or a ":" or is "localhost")
    component  := [a-z0-9]+ ( ( "." | "_" | "__" | "-"+ ) [a-z0-9]+ )*
    tag        := [A-Za-z0-9_][A-Za-z0-9_.-]{0,127}
    digest     := "sha256:" 64 hex digits

A name without a domain is on Docker Hub (``docker.io``), and a one-part name there is in
its ``library`` namespace: ``python:3.12`` is ``docker.io/library/python:3.12``. A name
with neither tag nor digest means ``:latest``. Pure: no I/O.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from sbx_api import errors

DOCKER_HUB = "docker.io"
DOCKER_HUB_API = "registry-1.docker.io"
"""Where Docker Hub's registry API answers (``docker.io`` itself does not)."""
MAX_LENGTH = 255
"""Longest reference, all of it (distribution limits the name to this)."""

_COMPONENT = r"[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*"
_HOST = r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)(?:\.(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?))*"
_DOMAIN = re.compile(rf"(?:{_HOST}|\[[0-9A-Fa-f:]+\])(?::[0-9]{{1,5}})?")
_PATH = re.compile(rf"{_COMPONENT}(?:/{_COMPONENT})*")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
DIGEST = re.compile(r"sha256:[a-f0-9]{64}")
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
_PORT = r"(?::[0-9]{1,5})?"
_IPV6 = r"\[[0-9A-Fa-f]*:[0-9A-Fa-f:]*\]"
_REGISTRY = rf"(?:(?:{_LABEL}(?:\.{_LABEL})+|localhost){_PORT}|{_LABEL}:[0-9]{{1,5}}|{_IPV6}{_PORT})"
_FIRST = r"[a-z0-9]+(?:(?:_|__|-+)[a-z0-9]+)*"
"""A first path part followed by more: with a "." it would be a registry host."""
PATTERN = (
    rf"^(?:{_REGISTRY}/{_COMPONENT}(?:/{_COMPONENT})*|{_FIRST}(?:/{_COMPONENT})+|{_COMPONENT})"
    rf"(?::{_TAG.pattern})?(?:@{DIGEST.pattern})?$"
)
"""What :func:`parse` accepts, as one regular expression (for JSON schemas: with
``maxLength`` :data:`MAX_LENGTH`; a test holds the two to each other)."""


@dataclass(frozen=True)
class Reference:
    """A parsed image reference. ``str()`` gives its full normalised form."""

    domain: str
    """The registry's name as written (``docker.io`` for Docker Hub)."""
    repository: str
    """The path inside the registry (``library/python``)."""
    tag: str | None = None
    digest: str | None = None
    """``sha256:...`` when the reference pins the content."""

    @property
    def name(self) -> str:
        return f"{self.domain}/{self.repository}"

    @property
    def api_host(self) -> str:
        """Where the registry API is (Docker Hub's differs from its name)."""
        return DOCKER_HUB_API if self.domain == DOCKER_HUB else self.domain

    @property
    def pinned(self) -> bool:
        return self.digest is not None

    def at(self, digest: str) -> Reference:
        """The same repository pinned to ``digest`` (the tag kept, for display)."""
        return Reference(self.domain, self.repository, self.tag, digest)

    def __str__(self) -> str:
        out = self.name
        if self.tag is not None:
            out += f":{self.tag}"
        if self.digest is not None:
            out += f"@{self.digest}"
        return out


def parse(text: str) -> Reference:
    """Parse and normalise ``text``; InvalidInput saying what is wrong otherwise."""
    if not isinstance(text, str) or not text:
        raise errors.InvalidInput("an image reference must be a non-empty string")
    if len(text) > MAX_LENGTH:
        raise errors.InvalidInput(f"image reference is longer than {MAX_LENGTH} characters")
    rest, digest = text, None
    if "@" in rest:
        rest, digest = rest.split("@", 1)
        if not DIGEST.fullmatch(digest):
            raise errors.InvalidInput(
                f"image reference {text!r}: the digest must be sha256: and 64 lower-case hex digits"
            )
    tag = None
    last = rest.rsplit("/", 1)[-1]
    if ":" in last:
        rest, tag = rest.rsplit(":", 1)
        if not _TAG.fullmatch(tag):
            raise errors.InvalidInput(
                f"image reference {text!r}: the tag {tag!r} must be 1-128 of letters, digits, _ . - "
                "(not starting with . or -)"
            )
    domain, path = _split_domain(text, rest)
    if not _PATH.fullmatch(path):
        raise errors.InvalidInput(
            f"image reference {text!r}: repository names are lower-case letters, digits and "
            "separators (. _ -) in /-separated parts, like python, library/python or org/tool"
        )
    if domain in (DOCKER_HUB, "index.docker.io", DOCKER_HUB_API):
        domain = DOCKER_HUB
        if "/" not in path:
            path = f"library/{path}"
    if tag is None and digest is None:
        tag = "latest"
    return Reference(domain, path, tag, digest)


def _split_domain(text: str, rest: str) -> tuple[str, str]:
    first, sep, remainder = rest.partition("/")
    if not sep or not ("." in first or ":" in first or first == "localhost"):
        return DOCKER_HUB, rest
    if not _DOMAIN.fullmatch(first):
        raise errors.InvalidInput(f"image reference {text!r}: {first!r} is not a valid registry host")
    return first, remainder


def is_loopback(host: str) -> bool:
    """Whether a registry host (with or without port) is this machine: ``localhost`` or a
    loopback address (a DNS name that merely starts with ``127.`` is not)."""
    bare = (
        host[1:].split("]", 1)[0]
        if host.startswith("[")
        else host.rsplit(":", 1)[0]
        if host.count(":") == 1
        else host
    )
    if bare.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(bare).is_loopback
    except ValueError:
        return False
