"""One HTTP/2 request through the proxy with a chosen :authority (run with proxy/.venv's
Python, which has the `h2` package): ``h2client.py PROXY_HOST PROXY_PORT CONNECT SNI
AUTHORITY PATH CA_FILE``. Prints the response status and body as JSON."""

from __future__ import annotations

import json
import socket
import ssl
import sys

import h2.config
import h2.connection
import h2.events


def main() -> None:
    proxy_host, proxy_port, connect, sni, authority, path, ca = sys.argv[1:8]
    sock = socket.create_connection((proxy_host, int(proxy_port)), timeout=20)
    sock.sendall(f"CONNECT {connect} HTTP/1.1\r\nHost: {connect}\r\n\r\n".encode())
    reply = b""
    while b"\r\n\r\n" not in reply:
        reply += sock.recv(4096)
    context = ssl.create_default_context(cafile=ca)
    context.set_alpn_protocols(["h2"])
    tls = context.wrap_socket(sock, server_hostname=sni)
    if tls.selected_alpn_protocol() != "h2":
        print(json.dumps({"status": None, "alpn": tls.selected_alpn_protocol(), "body": ""}))
        return
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    conn.send_headers(
        1,
        [(":method", "GET"), (":scheme", "https"), (":authority", authority), (":path", path)],
        end_stream=True,
    )
    tls.sendall(conn.data_to_send())
    status, body, done = None, b"", False
    while not done:
        data = tls.recv(65536)
        if not data:
            break
        for event in conn.receive_data(data):
            if isinstance(event, h2.events.ResponseReceived):
                status = int(dict(event.headers)[b":status"])
            elif isinstance(event, h2.events.DataReceived):
                body += event.data
                conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(
                event, h2.events.StreamEnded | h2.events.StreamReset | h2.events.ConnectionTerminated
            ):
                done = True
        tls.sendall(conn.data_to_send())
    print(json.dumps({"status": status, "body": body.decode(errors="replace")}))


if __name__ == "__main__":
    main()
