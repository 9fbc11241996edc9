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
* ``server_connect_error``, ``tls_failed_server``, ``error``: upstream failures.

Every hook reports what it saw to one :class:`egress.Tracker` (the front door reports to
the same one): the connection's verdict, refusals and why, requests, injections by rule.
The metrics (``metrics.py``, on the unix socket ``sbx_metrics_socket``) are derived there.

Nothing here logs a header value.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os

from mitmproxy import ctx, exceptions, http, tls
from mitmproxy.proxy import server_hooks

from sbx_proxy import config, credentials, egress, front, hosts, metrics, records, redact, refusals

log = logging.getLogger("sbx_proxy")
SECRETS = "sbx_secrets"
REFUSED = "sbx_refused"
"""Flow metadata: a refusal of this flow is counted already."""
OWNED = "addon-owned"
"""Connection flag: mitmproxy's own client (not handed by the front): the addon closes it."""
DESTINATION_REFUSED = "destination refused"
UPSTREAM_FAILED = "upstream-failed"
"""Connection flag: its upstream connection failed; the flow's error hook comes next."""


class CredentialProxy:
    def __init__(self) -> None:
        self.config = config.Config()
        self.providers: dict[str, credentials.Provider] = {}
        self.connects: dict[str, tuple[str, int]] = {}
        """CONNECT target (name, port) per client connection."""
        self.pins: dict[str, tuple[str, str]] = {}
        """(name, checked address) the tunnel of a client connection goes to."""
        self.front: front.Front | None = None
        self.tracker = egress.Tracker()
        self.conns: dict[str, egress.Connection] = {}
        """The egress record of each mitmproxy client connection."""
        self.metrics: metrics.Metrics | None = None
        self.records: records.EgressLog | None = None
        """The connections' egress records, until the proxy-scaler collects them."""
        self._metrics_server: asyncio.AbstractServer | None = None

    def load(self, loader) -> None:
        loader.add_option("sbx_config", str, "", "Path of the credential proxy's TOML config.")
        loader.add_option(
            "sbx_listen",
            str,
            "",
            "host:port of the front door (front.py); mitmproxy then listens on loopback.",
        )
        loader.add_option(
            "sbx_metrics_socket",
            str,
            "",
            "Serve Prometheus /metrics and the egress records on this unix socket (never on a "
            "port a sandbox could reach).",
        )
        loader.add_option(
            "sbx_egress_records",
            bool,
            True,
            "Keep a record of every connection for the audit stream (served on the metrics socket).",
        )

    async def running(self) -> None:
        await self._serve_metrics()
        if not ctx.options.sbx_listen:
            return
        inner = ctx.master.addons.get("proxyserver").listen_addrs()[0]
        host, _, port = ctx.options.sbx_listen.rpartition(":")
        self.front = front.Front(lambda: self.config, (str(inner[0]), int(inner[1])), self.tracker)
        try:
            await self.front.start(host.strip("[]"), int(port))
        except (OSError, ValueError) as exc:
            log.error("sbx_proxy: cannot listen at %s: %s", ctx.options.sbx_listen, exc)
            ctx.master.shutdown()
            return
        log.info("sbx_proxy: listening at %s (tunnels without a rule: spliced)", ctx.options.sbx_listen)

    async def _serve_metrics(self) -> None:
        path = ctx.options.sbx_metrics_socket
        if not path:
            return
        self.metrics = metrics.Metrics()
        self.metrics.rules(rule.name for rule in self.config.rules)
        self.tracker.sinks = (self.metrics,)
        if ctx.options.sbx_egress_records:
            self.records = records.EgressLog()
            self.metrics.registry.register(metrics.EgressCollector(self.records))
            self.tracker.sinks += (self.records,)
        try:
            self._metrics_server = await metrics.serve(self.metrics, path, self.records)
        except OSError as exc:  # counted anyway; egress must not stop for want of a scrape
            log.error("sbx_proxy: cannot serve metrics at %s: %s", path, exc)
            return
        log.info("sbx_proxy: metrics at unix:%s", path)

    async def done(self) -> None:
        if self.front is not None:
            await self.front.close()
        if self._metrics_server is not None:
            self._metrics_server.close()
            with contextlib.suppress(OSError):
                os.unlink(ctx.options.sbx_metrics_socket)

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
        if self.metrics is not None:
            self.metrics.rules(rule.name for rule in loaded.rules)
        log.info("sbx_proxy: %d rule(s) for %d host(s)", len(loaded.rules), len(loaded.configured))

    # ---- connections -------------------------------------------------------------

    async def _resolve(self, host: str, port: int) -> tuple[str | None, egress.Refusal | None]:
        return await front.resolve(self.config, host, port, self._own())

    def _own(self) -> front.Own:
        return self.front.own if self.front is not None else frozenset()

    def _refusal(self, address: str, port: int) -> egress.Refusal | None:
        return front.refusal(self.config, address, port, self._own())

    def _conn(self, client) -> egress.Connection:
        """The egress record of a mitmproxy client connection: the front's, found by its
        address on the hop to mitmproxy, or (no front) one of the addon's own."""
        conn = self.conns.get(client.id)
        if conn is None:
            conn = self.tracker.by_hop(client.peername)
            if conn is None and (self.front is not None or client.timestamp_end is not None):
                # The front's record is closed already (a late hook): counted, not kept.
                return self.tracker.detached(client.peername)
            if conn is None:
                conn = self.tracker.opened(client.peername)
                conn.flags.add(OWNED)
            self.conns[client.id] = conn
        return conn

    async def http_connect(self, flow: http.HTTPFlow) -> None:
        """Remember the CONNECT target, check it, and pin the tunnel to the checked address."""
        host, port = flow.request.host, flow.request.port
        conn = self._conn(flow.client_conn)
        self.connects[flow.client_conn.id] = (host, port)
        address, why = await self._resolve(host, port)
        if address is None:
            assert why is not None
            conn.host, conn.port = host, port
            self.tracker.refused(conn, why)
            flow.metadata[REFUSED] = True
            flow.response = _response(refusals.answer(f"CONNECT {host}:{port}", why))
            return
        self.pins[flow.client_conn.id] = (host, address)
        flow.request.data.host = address  # the tunnel's server address: no second lookup later
        rule = self.config.rule_for(host, port)
        mode = egress.Mode.TUNNEL if rule is None else egress.Mode.INTERCEPT
        self.tracker.routed(conn, mode, host, port, None if rule is None else rule.name)

    def client_disconnected(self, client) -> None:
        self.connects.pop(client.id, None)
        self.pins.pop(client.id, None)
        conn = self.conns.pop(client.id, None)
        if conn is not None and OWNED in conn.flags:
            self.tracker.closed(conn)

    def tls_clienthello(self, data: tls.ClientHelloData) -> None:
        target = self.connects.get(data.context.client.id)
        if target is None or self.config.rule_for(*target) is None:
            data.ignore_connection = True  # no credential to add: a plain tunnel, no interception

    async def server_connect(self, data: server_hooks.ServerConnectionHookData) -> None:
        """The last check before any connection: only checked addresses, TLS verified by name."""
        assert data.server.address is not None  # (set before mitmproxy connects)
        host, port = data.server.address
        if _is_ip(host):
            why = self._refusal(host, port)
            if why is not None:
                self.tracker.refused(self._conn(data.client), why)
                data.server.error = f"{DESTINATION_REFUSED}: {why}"
                return
            pin = self.pins.get(data.client.id)
            if pin is not None and pin[1] == host and data.server.sni in (None, host):
                data.server.sni = pin[0]  # upstream TLS is verified against the name, not the address
            return
        address, why = await self._resolve(host, port)  # not pinned earlier: pin now
        if address is None:
            assert why is not None
            self.tracker.refused(self._conn(data.client), why)
            data.server.error = f"{DESTINATION_REFUSED}: {why}"
            return
        if data.server.sni is None:
            data.server.sni = host
        data.server.address = (address, port)

    def server_connect_error(self, data: server_hooks.ServerConnectionHookData) -> None:
        error = data.server.error or ""
        if error.startswith(DESTINATION_REFUSED):
            return  # our own refusal, counted where it was decided
        conn = self._conn(data.client)
        self.tracker.upstream_failed(conn, egress.Stage.CONNECT)
        if conn.mode is egress.Mode.TUNNEL:  # no flow will report it: the tunnel just ends
            self.tracker.refused(conn, egress.Reason.UPSTREAM_FAILURE)
        else:
            conn.flags.add(UPSTREAM_FAILED)

    def tls_failed_server(self, data: tls.TlsData) -> None:
        conn = self._conn(data.context.client)
        self.tracker.upstream_failed(conn, egress.Stage.TLS)
        conn.flags.add(UPSTREAM_FAILED)

    def error(self, flow: http.HTTPFlow) -> None:
        """A flow that ended without a complete answer: the sandbox got mitmproxy's 502
        when its upstream connection failed just before; an exchange the upstream broke
        after its answer began is a protocol error."""
        if flow.metadata.get(REFUSED):
            return
        conn = self._conn(flow.client_conn)
        if flow.response is None:
            if UPSTREAM_FAILED in conn.flags:
                conn.flags.discard(UPSTREAM_FAILED)
                self.tracker.refused(conn, egress.Reason.UPSTREAM_FAILURE)
            return
        message = flow.error.msg if flow.error is not None else ""
        if "client" not in message.lower():
            self.tracker.upstream_failed(conn, egress.Stage.PROTOCOL)

    # ---- requests ----------------------------------------------------------------

    def _refuse(self, flow: http.HTTPFlow, why: egress.Refusal, status: int | None = None) -> None:
        request = flow.request
        what = f"{request.method} {request.pretty_host}:{request.port}"
        flow.response = _response(refusals.answer(what, why, status=status))
        self.tracker.refused(self._conn(flow.client_conn), why, request=True)
        flow.metadata[REFUSED] = True

    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        request = flow.request
        conn = self._conn(flow.client_conn)
        if flow.error is not None:  # mitmproxy's own validation (smuggling): it answers 400
            self.tracker.refused(conn, egress.Reason.BAD_REQUEST, request=True)
            flow.metadata[REFUSED] = True
            return
        if any(_bad_field(k) or _bad_field(v) for k, v in request.headers.fields):
            # mitmproxy keeps an obs-folded line as "value\r\n more": refuse, never forward it.
            return self._refuse(flow, egress.Refusal(egress.Reason.BAD_REQUEST, "folded or malformed header"))
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
            if connect is None and not await self._plain_destination(flow, conn):
                return
            self.tracker.requested(conn, egress.Outcome.PASSED)
            request.stream = True  # never buffer a body (uploads)
            return
        if decision.action == "refuse":
            log.warning("sbx_proxy: refused a request to %s: %s", decision.host, decision.reason)
            return self._refuse(flow, egress.Refusal(egress.Reason.HOST_MISMATCH, decision.reason or ""))
        assert connect is not None and decision.host is not None
        rule = self.config.rule_for(*connect)
        assert rule is not None
        pin = self.pins.get(flow.client_conn.id)
        if pin is None:
            unchecked = "the tunnel's destination was not checked"
            return self._refuse(flow, egress.Refusal(egress.Reason.UNCHECKED_TUNNEL, unchecked))
        path, _, query = request.path.partition("?")
        try:
            injection = await self.providers[rule.name].injection(decision.host, request.method, path, query)
        except Exception as exc:  # never forward without the credential the host expects
            log.error("sbx_proxy: rule %s could not provide a credential (%s)", rule.name, type(exc).__name__)
            missing = f"no credential could be had for {decision.host}"
            return self._refuse(flow, egress.Refusal(egress.Reason.CREDENTIAL_UNAVAILABLE, missing))
        request.data.host = pin[1]  # the checked address: the tunnel's connection is reused
        request.headers.pop("Authorization", None)
        request.stream = True  # never buffer a body (git pushes)
        if injection is None:
            self.tracker.requested(conn, egress.Outcome.PASSED, rule.name)
            return
        self.tracker.requested(conn, egress.Outcome.INJECTED, rule.name)
        for name, value in injection.headers.items():
            request.headers[name] = value
        # Uncompressed answers, so an echoed credential can be found and masked.
        request.headers["Accept-Encoding"] = "identity"
        flow.metadata[SECRETS] = injection.secrets
        log.info("sbx_proxy: %s %s via rule %s", request.method, decision.host, rule.name)

    async def _plain_destination(self, flow: http.HTTPFlow, conn: egress.Connection) -> bool:
        """Check a plain-HTTP request's destination (an address) or check and pin it (a
        name); False when refused (answered)."""
        request = flow.request
        self.tracker.routed(conn, egress.Mode.FORWARD, request.host, request.port)
        address: str | None = request.host
        if _is_ip(request.host):
            why = self._refusal(request.host, request.port)
        else:
            address, why = await self._resolve(request.host, request.port)
        if why is not None:
            self._refuse(flow, why, status=502)
            return False
        assert address is not None
        request.data.host = address  # keeps Host; lets connections be reused
        return True

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
            self.tracker.refused(self._conn(flow.client_conn), egress.Reason.COMPRESSED_ANSWER)
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


def _response(found: refusals.Answer) -> http.Response:
    response = http.Response.make(found.status, found.body, found.headers)
    response.reason = found.phrase
    return response


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    return True


def _bad_field(raw: bytes) -> bool:
    return b"\r" in raw or b"\n" in raw or b"\0" in raw


addons = [CredentialProxy()]
