"""What a refusal tells the sandbox (pure): a status, a reason phrase and a short body an
agent can act on, in one place for the front door and the addon.

Agents blocked by a policy retry blindly when the refusal says nothing (or unset the
proxy, which only fails differently: a sandbox has no other way out). So every refusal
says what was refused, why (the :class:`egress.Reason` and the checker's detail), and
what could change it: something the agent can do itself, or what the operator can
configure. The header ``X-Sbx-Refused`` carries the reason code for programs; the same
reason lands on the session's timeline (the egress record).

Nothing here names a header value or a secret: the detail is the checker's text (an
address, a name the sandbox chose) and the rest is fixed.
"""

from __future__ import annotations

from dataclasses import dataclass

from sbx_proxy import egress

HEADER = "X-Sbx-Refused"
"""Response header naming the refusal's reason code."""


@dataclass(frozen=True)
class Policy:
    status: int
    phrase: str
    why: str
    change: str


POLICIES: dict[egress.Reason, Policy] = {
    egress.Reason.PRIVATE_ADDRESS: Policy(
        403,
        "Private Destination Refused",
        "sandboxes reach only public addresses through their proxy",
        "an operator can allow this network in the proxy config ([destinations] allow); "
        "retrying, or unsetting the proxy, will not help: it is the sandbox's only way out",
    ),
    egress.Reason.METADATA_ADDRESS: Policy(
        403,
        "Metadata Address Refused",
        "cloud metadata addresses hold the host's credentials and are never reachable",
        "nothing: no configuration allows it",
    ),
    egress.Reason.UNRESOLVABLE: Policy(
        403,
        "Name Not Resolved",
        "the proxy resolves names for the sandbox (the sandbox has no DNS), and this one has no address",
        "check the name; if it is an internal name, an operator must make it resolvable on the proxy's host",
    ),
    egress.Reason.PROXY_ITSELF: Policy(
        403,
        "Proxy Address Refused",
        "the destination is the proxy's own listening address",
        "nothing: a request to the proxy itself would loop",
    ),
    egress.Reason.HOST_MISMATCH: Policy(
        421,
        "Misdirected Request",
        "inside a credentialed tunnel every request must go to the host the CONNECT "
        "named (TLS server name, Host and target alike)",
        "open a separate connection for each host",
    ),
    egress.Reason.BAD_REQUEST: Policy(
        400,
        "Bad Request",
        "the request was malformed or ambiguous (folded header lines, conflicting "
        "lengths), which could smuggle a second request past the checks",
        "send a well-formed HTTP/1.1 request",
    ),
    egress.Reason.CREDENTIAL_UNAVAILABLE: Policy(
        502,
        "Credential Unavailable",
        "the configured rule for this host could not produce its credential, and the "
        "request is never sent without it",
        "an operator must fix the rule's credential source (token, token endpoint, hook); "
        "retry once it is fixed",
    ),
    egress.Reason.UPSTREAM_FAILURE: Policy(
        502,
        "Destination Unreachable",
        "the destination did not accept the connection",
        "the destination may be down or refusing connections: retry later",
    ),
    egress.Reason.UNCHECKED_TUNNEL: Policy(
        502,
        "Unchecked Destination",
        "the tunnel's destination was never checked (a proxy fault)",
        "report it to the operator: the proxy refuses rather than send a credential unchecked",
    ),
    egress.Reason.COMPRESSED_ANSWER: Policy(
        502,
        "Compressed Answer Refused",
        "a credentialed request's answer came compressed, and could carry the credential unseen",
        "nothing on the sandbox's side: the destination ignored Accept-Encoding: identity",
    ),
}


@dataclass(frozen=True)
class Answer:
    status: int
    phrase: str
    body: str
    reason: str
    """The reason code (``X-Sbx-Refused``)."""

    @property
    def headers(self) -> dict[str, str]:
        return {"content-type": "text/plain; charset=utf-8", HEADER: self.reason}


def answer(what: str, refusal: egress.Refusal | egress.Reason, *, status: int | None = None) -> Answer:
    """The answer to a refused ``what`` (``CONNECT host:port``, ``GET host``...)."""
    reason = refusal.reason if isinstance(refusal, egress.Refusal) else refusal
    detail = refusal.detail if isinstance(refusal, egress.Refusal) else ""
    policy = POLICIES[reason]
    lines = [
        f"refused by the sandbox's egress proxy: {what[:300]}",
        f"reason: {reason.value}" + (f" ({detail[:300]})" if detail else ""),
        f"why: {policy.why}",
        f"what can change it: {policy.change}",
    ]
    return Answer(status or policy.status, policy.phrase, "\n".join(lines) + "\n", reason.value)


def head(found: Answer) -> bytes:
    """A whole HTTP/1.1 answer that closes the connection (the front door's CONNECT)."""
    body = found.body.encode()
    fields = "".join(f"{name}: {value}\r\n" for name, value in found.headers.items())
    return (
        f"HTTP/1.1 {found.status} {found.phrase}\r\n{fields}content-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    ).encode() + body
