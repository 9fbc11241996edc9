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

import ipaddress
import logging

from mitmproxy import ctx, exceptions, http, tls
from mitmproxy.proxy import server_hooks

from sbx_proxy import config, credentials, front, hosts, redact

log = logging.getLogger("sbx_proxy")
SECRETS = "sbx_secrets"


class CredentialProxy:
    def __init__(self) -> None:
        self.config = config.Config()
        self.providers: dict[str, credentials.Provider] = {}
        self.connects: dict[str, tuple[str, int]] = {}
        """CONNECT target (name, port) per client connection."""
        self.pins: dict[str, tuple[str, str]] = {}
        """(name, checked address) the tunnel of a client connection goes to."""
        self.front: front.Front | None = None

    def load(self, loader) -> None:
        loader.add_option("sbx_config", str, "", "Path of the credential proxy's TOML config.")
        loader.add_option(
            "sbx_listen",
            str,
            "",
            "host:port of the front door (front.py); mitmproxy then listens on loopback.",
        )

    async def running(self) -> None:
        if not ctx.options.sbx_listen:
            return
        inner = ctx.master.addons.get("proxyserver").listen_addrs()[0]
        host, _, port = ctx.options.sbx_listen.rpartition(":")
        self.front = front.Front(lambda: self.config, (str(inner[0]), int(inner[1])))
        try:
            await self.front.start(host.strip("[]"), int(port))
        except (OSError, ValueError) as exc:
            log.error("sbx_proxy: cannot listen at %s: %s", ctx.options.sbx_listen, exc)
            ctx.master.shutdown()
            return
        log.info("sbx_proxy: listening at %s (tunnels without a rule: spliced)", ctx.options.sbx_listen)

    async def done(self) -> None:
        if self.front is not None:
            await self.front.close()

    def configure(self, updated: set[str]) -> None:
        if "sbx_config" not in updated:
            return
        if not ctx.options.validate_inbound_headers:
            raise exceptions.OptionsError("sbx_proxy needs validate_inbound_headers=true (request smuggling)")
        try:
            loaded = config.load(ctx.options.sbx_config or None)
            providers = {rule.name: credentials.Provider(rule) for rule in loaded.rules}
        except config.ConfigError as exc:
            raise exceptions.OptionsError(f"sbx_config: {exc}") from None
        self.config, self.providers = loaded, providers
        log.info("sbx_proxy: %d rule(s) for %d host(s)", len(loaded.rules), len(loaded.configured))

    # ---- connections -------------------------------------------------------------

    async def _resolve(self, host: str, port: int) -> tuple[str | None, str | None]:
        return await front.resolve(self.config, host, port)

    async def http_connect(self, flow: http.HTTPFlow) -> None:
        """Remember the CONNECT target, check it, and pin the tunnel to the checked address."""
        host, port = flow.request.host, flow.request.port
        self.connects[flow.client_conn.id] = (host, port)
        address, why = await self._resolve(host, port)
        if address is None:
            flow.response = http.Response.make(403, f"destination refused: {why}\n")
            return
        self.pins[flow.client_conn.id] = (host, address)
        flow.request.data.host = address  # the tunnel's server address: no second lookup later

    def client_disconnected(self, client) -> None:
        self.connects.pop(client.id, None)
        self.pins.pop(client.id, None)

    def tls_clienthello(self, data: tls.ClientHelloData) -> None:
        target = self.connects.get(data.context.client.id)
        if target is None or self.config.rule_for(*target) is None:
            data.ignore_connection = True  # no credential to add: a plain tunnel, no interception

    async def server_connect(self, data: server_hooks.ServerConnectionHookData) -> None:
        """The last check before any connection: only checked addresses, TLS verified by name."""
        assert data.server.address is not None  # (set before mitmproxy connects)
        host, port = data.server.address
        if _is_ip(host):
            why = self.config.refusal(host)
            if why is not None:
                data.server.error = f"destination refused: {why}"
                return
            pin = self.pins.get(data.client.id)
            if pin is not None and pin[1] == host and data.server.sni in (None, host):
                data.server.sni = pin[0]  # upstream TLS is verified against the name, not the address
            return
        address, why = await self._resolve(host, port)  # not pinned earlier: pin now
        if address is None:
            data.server.error = f"destination refused: {why}"
            return
        if data.server.sni is None:
            data.server.sni = host
        data.server.address = (address, port)

    # ---- requests ----------------------------------------------------------------

    def _refuse(self, flow: http.HTTPFlow, status: int, why: str) -> None:
        flow.response = http.Response.make(status, f"refused by the credential proxy: {why}\n")

    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        request = flow.request
        if any(_bad_field(k) or _bad_field(v) for k, v in request.headers.fields):
            # mitmproxy keeps an obs-folded line as "value\r\n more": refuse, never forward it.
            return self._refuse(flow, 400, "folded or malformed header")
        request.headers.pop("Proxy-Authorization", None)
        connect = self.connects.get(flow.client_conn.id)
        route = hosts.Route(
            connect=connect,
            sni=flow.client_conn.sni,
            authority=request.host_header,
            scheme=request.scheme,
            client_tls=flow.client_conn.tls_established,
            target=request.authority if not request.is_http2 else "",
        )
        decision = hosts.decide(route, self.config.configured)
        if decision.action == "pass":
            if connect is None and not _is_ip(request.host):  # plain HTTP: check and pin here
                address, why = await self._resolve(request.host, request.port)
                if address is None:
                    return self._refuse(flow, 502, f"destination refused: {why}")
                request.data.host = address  # keeps Host; lets connections be reused
            request.stream = True  # never buffer a body (uploads)
            return
        if decision.action == "refuse":
            log.warning("sbx_proxy: refused a request to %s: %s", decision.host, decision.reason)
            return self._refuse(flow, 421, decision.reason)
        assert connect is not None and decision.host is not None
        rule = self.config.rule_for(*connect)
        assert rule is not None
        pin = self.pins.get(flow.client_conn.id)
        if pin is None:
            return self._refuse(flow, 502, "the tunnel's destination was not checked")
        path, _, query = request.path.partition("?")
        try:
            injection = await self.providers[rule.name].injection(decision.host, request.method, path, query)
        except Exception as exc:  # never forward without the credential the host expects
            log.error("sbx_proxy: rule %s could not provide a credential (%s)", rule.name, type(exc).__name__)
            return self._refuse(flow, 502, f"no credential could be had for {decision.host}")
        request.data.host = pin[1]  # the checked address: the tunnel's connection is reused
        request.headers.pop("Authorization", None)
        request.stream = True  # never buffer a body (git pushes)
        if injection is None:
            return
        for name, value in injection.headers.items():
            request.headers[name] = value
        # Uncompressed answers, so an echoed credential can be found and masked.
        request.headers["Accept-Encoding"] = "identity"
        flow.metadata[SECRETS] = injection.secrets
        log.info("sbx_proxy: %s %s via rule %s", request.method, decision.host, rule.name)

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        response = flow.response
        assert response is not None
        secrets = flow.metadata.get(SECRETS)
        if not secrets:
            response.stream = True
            return
        encoding = response.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            # Asked for identity; a compressed answer could carry the credential unseen.
            log.warning("sbx_proxy: dropped a %s-encoded answer to a credentialed request", encoding)
            response.status_code, response.reason = 502, "Bad Gateway"
            response.headers.clear()
            response.headers["Content-Length"] = "0"
            response.stream = lambda _chunk: []
            return
        response.reason = redact.text(response.reason, secrets)
        for name in list(response.headers.keys()):
            values = response.headers.get_all(name)
            masked = [redact.text(v, secrets) for v in values]
            if masked != values:
                response.headers.set_all(name, masked)
        redactor = redact.Redactor(secrets)

        def masked_stream(chunk: bytes) -> list[bytes]:
            # Never hand mitmproxy an empty chunk: in a chunked HTTP/1.1 answer that is
            # the end-of-body marker (the redactor holds back a possible secret's prefix).
            out = redactor(chunk)
            return [out] if out else []

        response.stream = masked_stream

    def response(self, flow: http.HTTPFlow) -> None:
        secrets = flow.metadata.get(SECRETS)
        if secrets and flow.response is not None and flow.response.trailers:
            for name in list(flow.response.trailers.keys()):
                flow.response.trailers.set_all(
                    name, [redact.text(v, secrets) for v in flow.response.trailers.get_all(name)]
                )

    def websocket_message(self, flow: http.HTTPFlow) -> None:
        secrets = flow.metadata.get(SECRETS)
        if secrets and flow.websocket is not None and flow.websocket.messages:
            message = flow.websocket.messages[-1]
            masker = redact.Redactor(secrets)
            message.content = masker(message.content) + masker(b"")


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    return True


def _bad_field(raw: bytes) -> bool:
    return b"\r" in raw or b"\n" in raw or b"\0" in raw


addons = [CredentialProxy()]
