"""The mitmproxy addon: ``mitmdump -s addon.py --set sbx_config=PATH`` (``sbx-proxy`` does this).

Hooks, in the order a connection meets them:

* ``http_connect``: remember the CONNECT target per client connection (the only
  trustworthy statement of where the client wants to go).
* ``tls_clienthello``: a tunnel to a host without a rule is not intercepted at all.
* ``server_connect``: resolve the destination, refuse private/loopback/link-local/
  metadata addresses, and pin the connection to the checked address (no second lookup
  that DNS rebinding could answer differently); upstream TLS is verified against the name.
* ``requestheaders``: decide from CONNECT target + SNI + Host (``hosts.decide``); inject
  by replacing the client's own ``Authorization``; stream the body (large pushes).
* ``responseheaders``: mask injected secrets in headers and in the streamed body.

Nothing here logs a header value.
"""

from __future__ import annotations

import asyncio
import logging
import socket

from mitmproxy import ctx, exceptions, http, tls
from mitmproxy.proxy import server_hooks

from sbx_proxy import config, credentials, hosts, redact

log = logging.getLogger("sbx_proxy")
SECRETS = "sbx_secrets"


class CredentialProxy:
    def __init__(self) -> None:
        self.config = config.Config()
        self.providers: dict[str, credentials.Provider] = {}
        self.connects: dict[str, tuple[str, int]] = {}

    def load(self, loader) -> None:  # type: ignore[no-untyped-def]
        loader.add_option("sbx_config", str, "", "Path of the credential proxy's TOML config.")

    def configure(self, updated: set[str]) -> None:
        if "sbx_config" not in updated:
            return
        try:
            loaded = config.load(ctx.options.sbx_config or None)
            providers = {rule.name: credentials.Provider(rule) for rule in loaded.rules}
        except config.ConfigError as exc:
            raise exceptions.OptionsError(f"sbx_config: {exc}") from None
        self.config, self.providers = loaded, providers
        log.info("sbx_proxy: %d rule(s) for %d host(s)", len(loaded.rules), len(loaded.configured))

    # ---- connections -------------------------------------------------------------

    def http_connect(self, flow: http.HTTPFlow) -> None:
        self.connects[flow.client_conn.id] = (flow.request.host, flow.request.port)

    def client_disconnected(self, client) -> None:  # type: ignore[no-untyped-def]
        self.connects.pop(client.id, None)

    def tls_clienthello(self, data: tls.ClientHelloData) -> None:
        target = self.connects.get(data.context.client.id)
        if target is None or self.config.rule_for(*target) is None:
            data.ignore_connection = True  # no credential to add: a plain tunnel, no interception

    async def server_connect(self, data: server_hooks.ServerConnectionHookData) -> None:
        host, port = data.server.address
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as exc:
            data.server.error = f"cannot resolve {host}: {exc}"
            return
        addresses = list(dict.fromkeys(info[4][0] for info in infos))
        for address in addresses:
            why = self.config.refusal(address)
            if why is not None:
                log.warning("sbx_proxy: refused %s:%s (%s)", host, port, why)
                data.server.error = f"destination refused: {why}"
                return
        if data.server.sni is None and host not in addresses:
            data.server.sni = host  # upstream TLS is verified against the name, not the address
        data.server.address = (addresses[0], port)

    # ---- requests ----------------------------------------------------------------

    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        request = flow.request
        if any(_bad_field(k) or _bad_field(v) for k, v in request.headers.fields):
            # mitmproxy keeps an obs-folded line as "value\r\n more": refuse, never forward it.
            flow.response = http.Response.make(400, b"refused: folded or malformed header\n")
            return
        request.stream = True  # never buffer a body (git pushes, uploads)
        request.headers.pop("Proxy-Authorization", None)
        route = hosts.Route(
            connect=self.connects.get(flow.client_conn.id),
            sni=flow.client_conn.sni,
            authority=request.host_header,
            scheme=request.scheme,
            client_tls=flow.client_conn.tls_established,
        )
        decision = hosts.decide(route, self.config.configured)
        if decision.action == "pass":
            return
        if decision.action == "refuse":
            log.warning("sbx_proxy: refused a request to %s: %s", decision.host, decision.reason)
            flow.response = http.Response.make(
                421, f"refused by the credential proxy: {decision.reason}\n", {"Content-Type": "text/plain"}
            )
            return
        assert route.connect is not None
        rule = self.config.rule_for(*route.connect)
        assert rule is not None and decision.host is not None
        path, _, query = request.path.partition("?")
        try:
            injection = await self.providers[rule.name].injection(decision.host, request.method, path, query)
        except Exception as exc:  # never forward without the credential the host expects
            log.error("sbx_proxy: rule %s could not provide a credential: %s", rule.name, exc)
            flow.response = http.Response.make(
                502, f"the credential proxy could not get a credential for {decision.host}\n"
            )
            return
        request.headers.pop("Authorization", None)
        if injection is None:
            return
        for name, value in injection.headers.items():
            request.headers[name] = value
        # Uncompressed answers, so an echoed credential can be found and masked.
        request.headers["Accept-Encoding"] = "identity"
        flow.metadata[SECRETS] = injection.secrets
        log.info("sbx_proxy: %s %s via rule %s", request.method, decision.host, rule.name)

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        assert flow.response is not None
        secrets = flow.metadata.get(SECRETS)
        if not secrets:
            flow.response.stream = True
            return
        for name, value in list(flow.response.headers.items(multi=True)):
            masked = redact.text(value, secrets)
            if masked != value:
                flow.response.headers.set_all(
                    name, [redact.text(v, secrets) for v in flow.response.headers.get_all(name)]
                )
        flow.response.stream = redact.Redactor(secrets)


def _bad_field(raw: bytes) -> bool:
    return b"\r" in raw or b"\n" in raw or b"\0" in raw


addons = [CredentialProxy()]
