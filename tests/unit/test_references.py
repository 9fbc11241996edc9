"""Image references: parsed and normalised as `docker pull` does (distribution's grammar)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sbx_api import errors
from shared.contract import references

DIGEST = "sha256:" + "0123456789abcdef" * 4


@pytest.mark.parametrize(
    ("text", "domain", "repository", "tag", "digest"),
    [
        ("python", "docker.io", "library/python", "latest", None),
        ("python:3.12-slim", "docker.io", "library/python", "3.12-slim", None),
        ("library/python:3", "docker.io", "library/python", "3", None),
        ("index.docker.io/library/alpine", "docker.io", "library/alpine", "latest", None),
        ("org/tool", "docker.io", "org/tool", "latest", None),
        ("ghcr.io/org/img:tag", "ghcr.io", "org/img", "tag", None),
        ("localhost/img", "localhost", "img", "latest", None),
        ("localhost:5000/a/b/c:v1", "localhost:5000", "a/b/c", "v1", None),
        ("127.0.0.1:5000/repo@" + DIGEST, "127.0.0.1:5000", "repo", None, DIGEST),
        ("host:5000/repo:tag@" + DIGEST, "host:5000", "repo", "tag", DIGEST),
        ("[::1]:5000/repo", "[::1]:5000", "repo", "latest", None),
        ("a__b/c-d.e", "docker.io", "a__b/c-d.e", "latest", None),
    ],
)
def test_references_parse_and_normalise(text, domain, repository, tag, digest) -> None:
    ref = references.parse(text)
    assert (ref.domain, ref.repository, ref.tag, ref.digest) == (domain, repository, tag, digest)
    assert references.parse(str(ref)) == ref  # the normalised form reads back the same


def test_docker_hub_is_asked_at_its_api_host() -> None:
    assert references.parse("python").api_host == "registry-1.docker.io"
    assert references.parse("ghcr.io/a/b").api_host == "ghcr.io"
    assert str(references.parse("python:3.12")) == "docker.io/library/python:3.12"


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("", "non-empty"),
        ("Python", "lower-case"),
        ("a b", "lower-case"),
        ("img:", "tag"),
        ("img:-x", "tag"),
        ("img:" + "x" * 129, "tag"),
        ("img@sha256:abc", "digest"),
        ("img@md5:" + "0" * 32, "digest"),
        ("bad_host.io:99999x/img", "registry host"),
        ("a//b", "lower-case"),
        ("-a/b", "lower-case"),
        ("a/b/", "lower-case"),
        ("x" * 600, "longer"),
    ],
)
def test_malformed_references_say_what_is_wrong(text: str, said: str) -> None:
    with pytest.raises(errors.InvalidInput, match=said):
        references.parse(text)


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("localhost:5000", True), ("127.0.0.1", True), ("127.1.2.3:80", True), ("[::1]:5000", True),
     ("registry.local", False), ("10.0.0.1:5000", False), ("localhost.evil.com", False),
     ("127.evil.example", False), ("127.0.0.1.attacker.com:443", False), ("::1", True)],
)  # fmt: skip
def test_loopback_hosts(host: str, loopback: bool) -> None:
    assert references.is_loopback(host) is loopback


@settings(max_examples=60, deadline=None)
@given(
    st.one_of(
        st.from_regex(references.PATTERN, fullmatch=True),
        st.text(alphabet="abcAB09._-:/@[]", max_size=40),
    )
)
def test_the_schema_pattern_accepts_exactly_what_parse_accepts(text: str) -> None:
    """The OpenAPI document states the rule as ``PATTERN`` and ``maxLength``; the server
    applies ``parse``: one must never refuse what the other allows."""
    import re

    by_pattern = bool(re.fullmatch(references.PATTERN, text)) and len(text) <= references.MAX_LENGTH
    try:
        references.parse(text)
        by_parse = True
    except errors.InvalidInput:
        by_parse = False
    assert by_pattern == by_parse, text
