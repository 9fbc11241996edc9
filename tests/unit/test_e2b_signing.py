"""envd's signed file URLs and host-name routing (services/gateway/e2b/signing.py): the
signature the SDK makes is the one checked; anything else about the URL is refused."""

from __future__ import annotations

import pytest

from services.gateway.e2b import connect, signing

e2b_signature = pytest.importorskip("e2b.sandbox.signature")
TOKEN = "f" * 64
NOW = 1_800_000_000


def fields(
    path: str, operation: str, user: str | None = None, expires_in: int | None = None
) -> dict[str, str]:
    made = e2b_signature.get_signature(path, operation, user, TOKEN, expires_in)
    out = {"path": path, "signature": made["signature"]}
    if user is not None:
        out["username"] = user
    if made["expiration"] is not None:
        out["signature_expiration"] = str(made["expiration"])
    return out


@pytest.mark.parametrize("path", ["/tmp/a.txt", "rel/ü b+c.txt", ""])
@pytest.mark.parametrize("user", [None, "root"])
def test_the_sdks_signatures_are_accepted(path, user):
    signing.check(fields(path, "read", user), "GET", TOKEN, NOW)
    signing.check(fields(path, "write", user, 600), "POST", TOKEN, 0)


def refusal(given: dict[str, str], method: str = "GET", now: float = 0) -> str:
    with pytest.raises(connect.ConnectError) as refused:
        signing.check(given, method, TOKEN, now)
    assert refused.value.code == "unauthenticated"
    return refused.value.message


def test_what_a_signature_does_not_cover_is_refused():
    read = fields("/tmp/a.txt", "read", expires_in=600)
    assert refusal(read, "POST") == "invalid signature"  # a read URL does not write
    assert refusal(fields("/tmp/a.txt", "write")) == "invalid signature"
    assert refusal(read | {"path": "/tmp/b.txt"}) == "invalid signature"
    assert refusal(read | {"username": "root"}) == "invalid signature"
    assert refusal(read | {"signature_expiration": "99999999999"}) == "invalid signature"
    assert refusal(read | {"signature_expiration": "-1"}) == "invalid signature_expiration"
    assert refusal(read, "DELETE") == "invalid signature"
    with pytest.raises(connect.ConnectError):
        signing.check(read, "GET", "0" * 64, 0)  # another sandbox's token
    assert refusal(fields("/tmp/a.txt", "read", expires_in=-5), now=NOW * 2) == "signature expired"
    assert refusal({"path": "/tmp/a.txt"}) == "missing X-Access-Token or signature"


def test_a_user_with_a_colon_is_refused():
    # "x:read::write::TOKEN" is both (x:read:, write, "") and (x, read, ":write:")
    signed = fields("x:read:", "write")
    assert refusal({"path": "x", "username": ":write:", "signature": signed["signature"]}) == (
        "invalid signature"
    )
    assert refusal(fields("x", "read", ":write:")) == "invalid signature"


def test_queries_are_bounded_and_unambiguous():
    assert signing.query(b"path=%2Ftmp%2F%C3%BC+b&signature=v1_x") == {
        "path": "/tmp/ü b",
        "signature": "v1_x",
    }
    for bad in (b"path=a&path=b", b"path=%FF", "path=ü".encode(), b"p=" + b"a" * signing.QUERY_MAX):
        with pytest.raises(connect.ConnectError) as refused:
            signing.query(bad)
        assert refused.value.code == "invalid_argument"


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("49983-e2b0123456789abcdef0123.sbx.example.com", ("49983", "e2b0123456789abcdef0123")),
        ("3000-abc.sbx.example.com", ("3000", "abc")),
        ("sbx.example.com", None),
        ("49983-abc.other.example.com", None),
        ("49983-abc.x.sbx.example.com", None),
        ("abc.sbx.example.com", None),
        ("49983-.sbx.example.com", None),
        ("123456-abc.sbx.example.com", None),
    ],
)
def test_routes(host, expected):
    assert signing.route(host, "sbx.example.com") == expected
    assert signing.route(host, "") is None
