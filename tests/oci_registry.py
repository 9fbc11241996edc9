"""A real OCI registry for tests, and images written by test code.

The registry is Debian's ``docker-registry`` (the CNCF distribution server) on loopback,
with htpasswd auth when users are given. Images are OCI layouts written here (layers as
gzip tars made with ``tarfile``) and pushed with ``skopeo`` — the tools an operator would
use, and no outside network.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import shutil
import subprocess
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from shared.runtime.local import registries
from tests import support

BUSYBOX = Path("/bin/busybox")
TOOLS = ("docker-registry", "skopeo")
OCI = "application/vnd.oci.image."


def missing_tools() -> list[str]:
    return [tool for tool in TOOLS if shutil.which(tool) is None] + (
        [] if BUSYBOX.exists() else ["busybox-static"]
    )


@dataclass
class Registry:
    root: Path
    users: dict[str, str] = field(default_factory=dict)
    """htpasswd users (basic auth), unless ``auth`` is given."""
    auth: dict[str, Any] | None = None
    """The registry's ``auth`` section as is (a token service's: ``TokenServer.auth_config``)."""
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    push_creds: str | None = None
    """``user:password`` skopeo pushes with."""

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> Registry:
        self.port = support.free_port()
        self.root.mkdir(parents=True, exist_ok=True)
        config = {
            "version": 0.1,
            "log": {"level": "error", "accesslog": {"disabled": False}},
            "storage": {"filesystem": {"rootdirectory": str(self.root / "data")}},
            "http": {"addr": self.host},
        }
        if self.auth is not None:
            config["auth"] = self.auth
        elif self.users:
            import bcrypt

            salt = bcrypt.gensalt(rounds=4)
            lines = [f"{u}:{bcrypt.hashpw(p.encode(), salt).decode()}" for u, p in self.users.items()]
            (self.root / "htpasswd").write_text("\n".join(lines) + "\n")
            config["auth"] = {"htpasswd": {"realm": "test", "path": str(self.root / "htpasswd")}}
        (self.root / "config.json").write_text(json.dumps(config))  # YAML is a superset of JSON
        log = (self.root / "registry.log").open("wb")
        self.proc = subprocess.Popen(
            ["docker-registry", "serve", str(self.root / "config.json")], stdout=log, stderr=log
        )
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://{self.host}/v2/", timeout=1).status_code in (200, 401):
                    return self
            except httpx.TransportError:
                time.sleep(0.05)
        raise RuntimeError(
            f"docker-registry did not start: {(self.root / 'registry.log').read_text()[-2000:]}"
        )

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)

    def requests(self, method: str = "GET", path_part: str = "") -> list[str]:
        """The request lines of the registry's access log with ``method`` and ``path_part``."""
        log = (self.root / "registry.log").read_text(errors="replace")
        return [line for line in log.splitlines() if f'"{method} /v2/' in line and path_part in line]

    def put_image(self, name: str, tag: str, layers: list[bytes]) -> str:
        """Upload blobs and a manifest of ``layers`` (which may repeat one blob) through
        the registry API, without skopeo; the manifest's digest."""
        base = f"http://{self.host}/v2/{name}"

        def upload(data: bytes) -> dict[str, object]:
            digest = "sha256:" + hashlib.sha256(data).hexdigest()
            started = httpx.post(f"{base}/blobs/uploads/", timeout=30)
            location = httpx.URL(f"http://{self.host}").join(started.headers["location"])
            done = httpx.put(location.copy_merge_params({"digest": digest}), content=data, timeout=30)
            done.raise_for_status()
            return {"digest": digest, "size": len(data)}

        config = json.dumps({"architecture": "amd64", "os": "linux", "config": {}}).encode()
        uploaded = {data: upload(data) for data in dict.fromkeys(layers)}
        manifest = json.dumps(
            {
                "schemaVersion": 2,
                "mediaType": OCI + "manifest.v1+json",
                "config": {"mediaType": OCI + "config.v1+json", **upload(config)},
                "layers": [{"mediaType": OCI + "layer.v1.tar+gzip", **uploaded[data]} for data in layers],
            }
        ).encode()
        put = httpx.put(
            f"{base}/manifests/{tag}", content=manifest, headers={"Content-Type": OCI + "manifest.v1+json"}
        )
        put.raise_for_status()
        return "sha256:" + hashlib.sha256(manifest).hexdigest()

    def push(self, layout: Path, name: str, *, all_platforms: bool = False, user: str | None = None) -> None:
        """Push the layout's ``latest`` to ``<registry>/<name>`` with skopeo."""
        args = ["skopeo", "copy", "-q", "--dest-tls-verify=false", "--insecure-policy"]
        if all_platforms:
            args.append("--all")
        if user is not None:
            args += ["--dest-creds", f"{user}:{self.users[user]}"]
        elif self.push_creds is not None:
            args += ["--dest-creds", self.push_creds]
        subprocess.run(
            [*args, f"oci:{layout}:latest", f"docker://{self.host}/{name}"], check=True, capture_output=True
        )


def allow(*hosts: str) -> registries.RegistryConfig:
    """An operator's registry configuration naming ``hosts`` (test registries on loopback)
    as insecure: the puller reaches loopback only for hosts the operator names."""
    return registries.RegistryConfig({host: registries.Registry(insecure=True) for host in hosts})


def registries_file(path: Path, *hosts: str) -> Path:
    """The same as a ``SBX_REGISTRIES_FILE`` for a stack."""
    path.write_text("".join(f'[registries."{host}"]\ninsecure = true\n' for host in hosts))
    return path


# ---- writing images ---------------------------------------------------------------


@dataclass(frozen=True)
class Link:
    target: str
    hard: bool = False


@dataclass(frozen=True)
class Dir:
    mode: int = 0o755


Entry = bytes | Link | Dir


def layer(entries: dict[str, Entry], *, compress: bool = True) -> bytes:
    """A layer tar (gzip by default): names map to file contents, links or directories;
    ``.wh.NAME`` and ``.wh..wh..opq`` entries are whiteouts, as Docker writes them."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, entry in entries.items():
            info = tarfile.TarInfo(name)
            info.mtime = 1_700_000_000
            data = None
            if isinstance(entry, Dir):
                info.type, info.mode = tarfile.DIRTYPE, entry.mode
            elif isinstance(entry, Link):
                info.type = tarfile.LNKTYPE if entry.hard else tarfile.SYMTYPE
                info.linkname = entry.target
            else:
                info.size, info.mode = len(entry), 0o755
                data = io.BytesIO(entry)
            tar.addfile(info, data)
    body = raw.getvalue()
    return gzip.compress(body, mtime=0) if compress else body


def busybox_layer() -> bytes:
    """A static busybox as /bin/sh and every other applet it has (as Alpine's base image
    has them), with /etc/passwd."""
    entries: dict[str, Entry] = {"bin": Dir(), "bin/busybox": BUSYBOX.read_bytes(), "etc": Dir()}
    applets = subprocess.run([str(BUSYBOX), "--list"], capture_output=True, text=True, check=True).stdout
    for applet in applets.split():
        if applet != "busybox" and "/" not in applet:
            entries[f"bin/{applet}"] = Link("busybox")
    entries["etc/passwd"] = b"root:x:0:0:root:/root:/bin/sh\n"
    return layer(entries)


def _plain(data: bytes) -> bytes:
    return gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data


def _blob(layout: Path, data: bytes) -> dict[str, object]:
    digest = hashlib.sha256(data).hexdigest()
    (layout / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    (layout / "blobs" / "sha256" / digest).write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


def image_manifest(
    layout: Path, layers: list[bytes], config: dict | None = None, arch: str = "amd64"
) -> dict:
    """Write an image's blobs into ``layout``; its manifest descriptor."""
    diff_ids = ["sha256:" + hashlib.sha256(_plain(data)).hexdigest() for data in layers]
    document = {
        "architecture": arch,
        "os": "linux",
        "config": config or {},
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    }
    config_desc = {
        "mediaType": "application/vnd.oci.image.config.v1+json",
        **_blob(layout, json.dumps(document).encode()),
    }
    layer_descs = [
        {
            "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip"
            if data[:2] == b"\x1f\x8b"
            else "application/vnd.oci.image.layer.v1.tar",
            **_blob(layout, data),
        }
        for data in layers
    ]
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": config_desc,
        "layers": layer_descs,
    }
    return {
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        **_blob(layout, json.dumps(manifest).encode()),
    }


def write_layout(layout: Path, images: list[tuple[dict, str | None]]) -> None:
    """An OCI layout whose ``latest`` is the one manifest given, or an index of several
    ``(descriptor, architecture)``."""
    layout.mkdir(parents=True, exist_ok=True)
    (layout / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    if len(images) == 1 and images[0][1] is None:
        top = images[0][0]
    else:
        index = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": [{**d, "platform": {"os": "linux", "architecture": arch}} for d, arch in images],
        }
        top = {
            "mediaType": "application/vnd.oci.image.index.v1+json",
            **_blob(layout, json.dumps(index).encode()),
        }
    ref = {**top, "annotations": {"org.opencontainers.image.ref.name": "latest"}}
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [ref]}))


def simple_image(layout: Path, *layers: bytes, config: dict | None = None) -> str:
    """A one-platform image of busybox plus ``layers``; its manifest digest."""
    descriptor = image_manifest(layout, [busybox_layer(), *layers], config)
    write_layout(layout, [(descriptor, None)])
    return str(descriptor["digest"])


# ---- a token service, for registries that use the bearer-token flow (Docker Hub, GHCR) ----


class TokenServer:
    """The token service of a ``docker-registry`` configured with ``auth: token``: it hands
    out RS256 JWTs (``x5c``: its self-signed certificate, which the registry trusts) for
    the scopes a request asks, to the users it knows (by basic auth); anonymous requests
    get a token that grants nothing. Runs in a thread of the test process."""

    def __init__(self, root: Path, users: dict[str, str], service: str = "test-registry") -> None:
        import datetime as dt

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import rsa
        from cryptography.x509.oid import NameOID

        self.users, self.service, self.issuer = users, service, "test-issuer"
        self.key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test token issuer")])
        now = dt.datetime.now(dt.UTC)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(hours=1))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )
        root.mkdir(parents=True, exist_ok=True)
        self.bundle = root / "token-ca.pem"
        self.bundle.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))
        self.requests: list[tuple[str | None, str]] = []
        self.port = support.free_port()
        self._server: Any = None

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def realm(self) -> str:
        return f"http://127.0.0.1:{self.port}/token"

    def auth_config(self) -> dict[str, Any]:
        return {
            "token": {
                "realm": self.realm,
                "service": self.service,
                "issuer": self.issuer,
                "rootcertbundle": str(self.bundle),
            }
        }

    def token(self, user: str | None, scope: str) -> str:
        import base64
        import secrets

        import jwt
        from cryptography.hazmat.primitives import serialization

        access = []
        if user is not None and scope.startswith("repository:"):
            _, name, actions = scope.split(":", 2)
            access.append({"type": "repository", "name": name, "actions": actions.split(",")})
        now = int(time.time())
        claims = {
            "iss": self.issuer, "sub": user or "", "aud": self.service, "exp": now + 300, "nbf": now - 10,
            "iat": now, "jti": secrets.token_hex(8), "access": access,
        }  # fmt: skip
        x5c = [base64.b64encode(self.cert.public_bytes(serialization.Encoding.DER)).decode()]
        return jwt.encode(claims, self.key, algorithm="RS256", headers={"x5c": x5c})

    def start(self) -> TokenServer:
        import base64
        import http.server
        import threading
        import urllib.parse

        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                query = urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query)
                user = None
                header = self.headers.get("Authorization", "")
                if header.startswith("Basic "):
                    name, _, password = base64.b64decode(header[6:]).decode().partition(":")
                    if outer.users.get(name) != password:
                        self.send_response(401)
                        self.end_headers()
                        return
                    user = name
                scope = (query.get("scope") or [""])[0]
                outer.requests.append((user, scope))
                body = json.dumps({"token": outer.token(user, scope)}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


def host_bash_layer() -> bytes:
    """The host's bash and the libraries it links, as a layer (for images with bash)."""
    bash = Path(shutil.which("bash") or "/bin/bash").resolve()
    entries: dict[str, Entry] = {"bin": Dir(), "bin/bash": bash.read_bytes()}
    libs = subprocess.run(["ldd", str(bash)], capture_output=True, text=True, check=True).stdout
    for line in libs.splitlines():
        path = next((p for p in line.split() if p.startswith("/")), None)
        if path:
            parts = path.strip("/").split("/")
            for depth in range(1, len(parts)):
                entries.setdefault("/".join(parts[:depth]), Dir())
            entries["/".join(parts)] = Path(path).resolve().read_bytes()
    return layer(entries)


# ---- a hostile registry: answers no honest registry gives (plain HTTP, loopback) ----------


class HostileRegistry:
    """A registry that lies: it serves whatever manifests and blobs a test gives it, may
    send them a byte at a time, and may redirect. For attacks a real registry cannot be
    made to carry out (docker-registry checks what it is pushed)."""

    def __init__(self) -> None:
        import http.server
        import threading

        self.manifests: dict[str, tuple[bytes, str]] = {}
        self.blobs: dict[str, bytes] = {}
        self.trickle: dict[str, float] = {}
        """Path tail (a tag, a digest) -> seconds between bytes."""
        self.redirects: dict[str, str] = {}
        """Digest (or tag) -> URL its blob (manifest) is redirected to."""
        self.challenge: str | None = None
        """A ``WWW-Authenticate`` value: every request is answered 401 with it."""
        self.seen: list[str] = []
        """Every request's path and query, in order."""
        self.authorizations: list[str | None] = []
        """Every request's ``Authorization``, in order."""
        self.encodings: dict[str, str] = {}
        """Path tail -> a ``Content-Encoding`` its (already encoded) body is sent with."""
        self.slow_heads: set[str] = set()
        """Path tails answered with endless headers, a byte every 50 ms."""
        self.port = support.free_port()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                outer.seen.append(self.path)
                outer.authorizations.append(self.headers.get("Authorization"))
                path = self.path.split("?")[0]
                tail = path.rsplit("/", 1)[-1]
                if tail in outer.slow_heads:
                    try:
                        for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 100_000:
                            self.wfile.write(bytes([byte]))
                            self.wfile.flush()
                            time.sleep(0.05)
                    except OSError:
                        pass
                    return None
                if outer.challenge is not None:
                    self.send_response(401)
                    self.send_header("WWW-Authenticate", outer.challenge)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return None
                if path == "/v2/":
                    return self.send(b"{}", "application/json")
                if tail in outer.redirects:
                    self.send_response(307)
                    self.send_header("Location", outer.redirects[tail])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return None
                if "/manifests/" in path and tail in outer.manifests:
                    body, media_type = outer.manifests[tail]
                    return self.send(
                        body, media_type, outer.trickle.get(tail), encoding=outer.encodings.get(tail)
                    )
                if "/blobs/" in path and tail in outer.blobs:
                    return self.send(outer.blobs[tail], "application/octet-stream", outer.trickle.get(tail))
                return self.send(
                    b'{"errors":[{"code":"NAME_UNKNOWN","message":"no such thing"}]}', "application/json", 404
                )

            def send(
                self,
                body: bytes,
                media_type: str,
                trickle: float | None = None,
                code: int = 200,
                encoding: str | None = None,
            ) -> None:
                self.send_response(code)
                self.send_header("Content-Type", media_type)
                if encoding:
                    self.send_header("Content-Encoding", encoding)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    if not trickle:
                        self.wfile.write(body)
                        return
                    for index in range(len(body)):
                        self.wfile.write(body[index : index + 1])
                        self.wfile.flush()
                        time.sleep(trickle)
                except OSError:
                    return

        class Server(http.server.ThreadingHTTPServer):
            def verify_request(self, request: Any, client_address: Any) -> bool:
                outer.connections += 1
                return True

        self.connections = 0
        """TCP connections accepted (a TLS handshake that fails is one too)."""
        self.server = Server(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def blob(self, data: bytes) -> str:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        self.blobs[digest] = data
        return digest

    def image(
        self, tag: str, layers: list[bytes], *, sizes: bool = True, manifest: bytes | None = None
    ) -> str:
        """Serve an image (or the raw ``manifest`` given) under ``tag`` and its digest."""
        config = json.dumps({"architecture": "amd64", "os": "linux", "config": {}}).encode()
        document = {
            "schemaVersion": 2,
            "mediaType": OCI + "manifest.v1+json",
            "config": {"mediaType": OCI + "config.v1+json", "digest": self.blob(config), "size": len(config)},
            "layers": [
                {
                    "mediaType": OCI + "layer.v1.tar+gzip",
                    "digest": self.blob(data),
                    **({"size": len(data)} if sizes else {}),
                }
                for data in layers
            ],
        }
        body = manifest if manifest is not None else json.dumps(document).encode()
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        self.manifests[tag] = self.manifests[digest] = (body, OCI + "manifest.v1+json")
        return digest

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
