"""``sbx-proxy``: start mitmdump with the credential addon and safe settings.

    sbx-proxy --config /etc/sbx-proxy/config.toml --listen-host 10.200.0.1 --listen-port 3128 \
              --confdir /var/lib/sbx-proxy/ca --metrics-socket /var/lib/sbx-proxy/metrics.sock

The CA is created in ``--confdir`` on first start (``mitmproxy-ca-cert.pem`` is the public
certificate to give sandboxes; ``mitmproxy-ca.pem`` holds the private key and must stay
on the proxy's side). Prometheus metrics are served only on a unix socket
(``--metrics-socket``; ``curl --unix-socket PATH http://proxy/metrics``), never on a port
a sandbox could ask the proxy to connect to; the same socket hands the per-connection
egress records to the proxy-scaler (``GET /egress``, ``records.py``). The config is
checked before mitmdump starts: a bad config stops start-up with a message naming the
field.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from sbx_proxy import config


def mitmdump_args(args: argparse.Namespace) -> list[str]:
    addon = Path(__file__).with_name("addon.py")
    argv = [
        "--mode", "regular",
        # mitmproxy listens on a loopback port of its own; the front door (front.py) owns
        # the public port, tunnels hosts without a rule itself and hands it the rest.
        "--listen-host", "127.0.0.1",
        "--listen-port", "0",
        "--set", f"sbx_listen={args.listen_host}:{args.listen_port}",
        "--set", f"confdir={args.confdir}",
        "--set", "flow_detail=0",            # never print flows (headers would carry tokens)
        "--set", "termlog_verbosity=info",
        "--set", "validate_inbound_headers=true",  # smuggling: conflicting lengths, bad names
        "--set", "block_global=false",       # clients come from sandbox veth addresses
        "--set", "connection_strategy=lazy",  # connect upstream only once the request is known
        # HTTP/1.1 only towards sandboxes: fewer parsers and no :authority/coalescing cases,
        # and mitmproxy 11 does not frame a streamed HTTP/2 body for an HTTP/1.1 upstream.
        "--set", "http2=false",
        "-s", str(addon),
        "--set", f"sbx_config={args.config or ''}",
    ]  # fmt: skip
    if args.upstream_ca:
        argv += ["--set", f"ssl_verify_upstream_trusted_ca={args.upstream_ca}"]
    if args.metrics_socket:
        argv += ["--set", f"sbx_metrics_socket={args.metrics_socket}"]
    if args.no_egress_records:
        argv += ["--set", "sbx_egress_records=false"]
    return argv


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="sbx-proxy", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=os.environ.get("SBX_PROXY_CONFIG", ""))
    parser.add_argument("--listen-host", default="127.0.0.1")
    parser.add_argument("--listen-port", type=int, default=3128)
    parser.add_argument("--confdir", help="where the proxy's CA lives (created if missing)")
    parser.add_argument("--check", action="store_true", help="only check the config, then exit")
    parser.add_argument(
        "--env-names",
        action="store_true",
        help="with --check: print the environment variables the config's secrets come from (JSON)",
    )
    parser.add_argument(
        "--init-ca", action="store_true", help="only create the CA in --confdir (if missing), then exit"
    )
    parser.add_argument(
        "--upstream-ca", help="trust this CA bundle for upstream servers (tests, private CAs)"
    )
    parser.add_argument(
        "--metrics-socket",
        help="serve Prometheus /metrics and the egress records (GET /egress) on this unix socket "
        "(mode 0600; no TCP port is ever opened)",
    )
    parser.add_argument(
        "--no-egress-records",
        action="store_true",
        help="keep no per-connection egress records (they are collected from --metrics-socket)",
    )
    args = parser.parse_args(argv)
    try:
        loaded = config.load(args.config or None)
    except config.ConfigError as exc:
        sys.exit(f"sbx-proxy: {exc}")
    if args.check:
        if args.env_names:
            print(json.dumps(list(loaded.env_names)))
        return
    if not args.confdir:
        parser.error("--confdir is required")
    Path(args.confdir).mkdir(parents=True, exist_ok=True, mode=0o700)
    if args.init_ca:
        from mitmproxy import certs

        certs.CertStore.from_store(args.confdir, "mitmproxy", 2048)
        return
    mitmdump = shutil.which("mitmdump", path=str(Path(sys.executable).parent)) or shutil.which("mitmdump")
    if mitmdump is None:
        sys.exit("sbx-proxy: mitmdump not found; run scripts/setup (it installs proxy/.venv)")
    os.execv(mitmdump, [mitmdump, *mitmdump_args(args)])  # noqa: S606 - a fixed program, no shell


if __name__ == "__main__":
    main()
