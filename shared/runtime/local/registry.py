"""A small client of the OCI distribution API (what ``docker pull`` speaks), on httpx.

Only what pulling an image needs: a manifest by tag or digest (an index resolved to this
machine's platform), and blobs streamed to a file while their digest is checked. Each
answer is checked against its digest, so neither a registry nor anything between us and
it can change an image unnoticed.

* **Auth**: anonymous first; a ``401`` with a ``Bearer`` challenge is answered with a
  token from the challenge's realm (with the operator's credentials for that registry,
  if any: Docker Hub's and GHCR's flow), a ``Basic`` challenge with those credentials.
  Credentials come only from the operator's registry configuration (``registries.py``);
  they are never logged, never put into an error, and never sent to another origin than
  the registry or the realm it names (dropped on a redirect elsewhere, which is where
  blobs usually live).
* **Egress**: a reference is a tenant's choice, and this runs on the host. Every hop (the
  registry, each redirect, followed here and at most :data:`MAX_REDIRECTS`, and the token
  realm) is resolved here, every address it has must be public
  (``shared/domain/destinations.py``, the credential proxy's rule) unless the operator
  names the host (``registries.py``), and the connection goes to the address checked (no
  second lookup: the URL carries the address, TLS still verifies the name). Plain HTTP
  only to hosts listed as ``insecure``. Whatever stops a registry from being reached (no
  such name, a refused address, nothing listening, not HTTP, TLS) is one error text, so
  errors tell nothing of what listens where; the operator's log has the reason. Proxy
  variables of the host are not used: a forward proxy would choose the address.
* **Transport**: HTTPS, mirrors tried before the registry itself. One connection pool
  per host name, so a connection made for one name (its TLS name) never serves another.
* **Retries**: connection errors, ``429`` and ``5xx`` are retried (3 attempts, backing off).

Why our own client rather than ``oras`` or ``skopeo``: both would still leave us the
layer store, the platform choice and digest checks of our own unpacking; ``oras`` is
written for artifacts (no manifest lists, no platform choice) and ``skopeo`` is a binary
that can give no progress per layer. This module is ~500 lines with one dependency we
already have, and streams each blob straight to disk while hashing it.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import platform
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpcore
import httpx
import structlog

from sbx_api import errors
from shared.contract import references
from shared.domain import destinations
from shared.runtime.local.registries import RegistryConfig

log = structlog.get_logger(__name__)

INDEX_TYPES = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
)
MANIFEST_TYPES = (
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
)
ACCEPT = ", ".join((*INDEX_TYPES, *MANIFEST_TYPES))
MANIFEST_MAX = 4 * 1024**2
ATTEMPTS = 3
BACKOFF = 0.5
MAX_REDIRECTS = 5
REDIRECTS = (301, 302, 303, 307, 308)
UNREACHABLE = (
    "registry {host} cannot be reached (a registry on a private or loopback address must be "
    "named in SBX_REGISTRIES_FILE)"
)
"""The one text for every registry that cannot be reached, whatever the reason."""
_ARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}
_CHALLENGE = re.compile(r'(\w+)="([^"]*)"')


def machine_platform() -> tuple[str, str]:
    """``(os, architecture)`` as OCI names them, for this machine."""
    machine = platform.machine().lower()
    return "linux", _ARCH.get(machine, machine)


class PullError(errors.InvalidInput):
    """The registry or the image is wrong in a way a retry does not fix."""


class Refused(Exception):
    """A hop's destination is not allowed (its reason is for the operator's log only)."""


Resolver = Callable[[str, int], list[str]]
"""A host name and port to the addresses it has."""


def resolve_addresses(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


@dataclass(frozen=True)
class Manifest:
    """An image manifest (one platform), with the digest it was fetched by."""

    digest: str
    media_type: str
    config: dict[str, Any]
    layers: list[dict[str, Any]]
    body: bytes


class _Streams(httpcore.SyncBackend):
    """The network backend of a client's connections that keeps each one's stream, so that
    :meth:`Client.expire` can shut them down from another thread: a registry that trickles
    its answer a byte at a time (headers included) never trips a read timeout, and closing
    a socket does not wake a thread blocked reading it; shutting it down does."""

    def __init__(self) -> None:
        super().__init__()
        self._open: list[_Tracked] = []
        self._lock = threading.Lock()
        self.expired = False

    def connect_tcp(self, *args: Any, **kwargs: Any) -> httpcore.NetworkStream:
        stream = _Tracked(super().connect_tcp(*args, **kwargs), self)
        with self._lock:
            self._open = [s for s in self._open if not s.closed]
            self._open.append(stream)
            expired = self.expired
        if expired:
            stream.shut()
        return stream

    def shut_all(self) -> None:
        with self._lock:
            self.expired = True
            streams = list(self._open)
        for stream in streams:
            stream.shut()


class _Tracked(httpcore.NetworkStream):
    def __init__(self, inner: httpcore.NetworkStream, owner: _Streams) -> None:
        self.inner, self.owner, self.closed = inner, owner, False

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self.inner.read(max_bytes, timeout)

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self.inner.write(buffer, timeout)

    def close(self) -> None:
        self.closed = True
        self.inner.close()

    def start_tls(self, *args: Any, **kwargs: Any) -> httpcore.NetworkStream:
        self.inner = self.inner.start_tls(*args, **kwargs)
        return self

    def get_extra_info(self, info: str) -> Any:
        return self.inner.get_extra_info(info)

    def shut(self) -> None:
        sock = self.inner.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


class Client:
    """Talks to the registries of ``config``; safe to share between threads."""

    def __init__(
        self, config: RegistryConfig, *, timeout: float = 30.0, resolver: Resolver = resolve_addresses
    ) -> None:
        self.config = config
        self._timeout = httpx.Timeout(timeout, connect=10.0)
        self._resolve = resolver
        self._clients: dict[str, httpx.Client] = {}
        self._tokens: dict[tuple[str, str], str] = {}
        self._schemes: dict[str, str] = {}
        self._lock = threading.Lock()
        self._streams = _Streams()
        self.deadline: float | None = None
        """``time.monotonic()`` by which every answer must be in (a pull's timeout): checked
        on every chunk, and :meth:`expire` (a pull's watchdog) shuts every connection
        down at it, so a registry that trickles bytes, headers included, cannot hold a pull."""

    def check_deadline(self) -> None:
        if self._streams.expired or (self.deadline is not None and time.monotonic() > self.deadline):
            raise errors.Timeout("the pull took too long (SBX_IMAGE_PULL_TIMEOUT); nothing was kept")

    def expire(self) -> None:
        """The deadline has passed: every connection is shut down now (a thread blocked
        reading one wakes up) and every later request refused (``check_deadline``)."""
        self._streams.shut_all()

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()

    def _client(self, host: str) -> httpx.Client:
        """The connection pool for one host name (its connections carry its TLS name)."""
        with self._lock:
            if (client := self._clients.get(host)) is None:
                transport = httpx.HTTPTransport(trust_env=False)
                transport._pool._network_backend = self._streams  # (httpx takes no backend of its own)
                client = self._clients[host] = httpx.Client(
                    timeout=self._timeout,
                    follow_redirects=False,
                    trust_env=False,
                    transport=transport,
                    headers={"User-Agent": "cloud-agent-sandbox", "Accept-Encoding": "identity"},
                )
            return client

    # ---- egress: every hop checked, pinned, redirects followed here ----------------

    def destination(self, url: httpx.URL) -> str:
        """The address to connect to for ``url``, checked; raises :class:`Refused`."""
        scheme, host = url.scheme, url.host
        port = url.port or (443 if scheme == "https" else 80)
        if scheme not in ("https", "http"):
            raise Refused(f"{url.host}: scheme {scheme!r}")
        if scheme == "http" and not self.config.insecure(host, port):
            raise Refused(f"{host}:{port}: plain HTTP to a host not listed as insecure")
        try:
            addresses = self._resolve(host, port)
        except (OSError, UnicodeError) as exc:
            raise Refused(f"{host}: cannot resolve ({type(exc).__name__}: {exc})") from None
        if not addresses:
            raise Refused(f"{host} has no address")
        if not self.config.names(host, port, scheme):
            for address in addresses:
                if (why := destinations.refusal(address)) is not None:
                    raise Refused(f"{host}:{port}: {why}")
        return addresses[0]

    def _send(
        self, url: httpx.URL, headers: dict[str, str], *, credentials_for: httpx.URL | None = None
    ) -> tuple[httpx.Response, httpx.URL]:
        """GET ``url`` (streamed), following redirects; each hop checked and pinned; the
        answer, and the URL of the hop that gave it. ``Authorization`` goes only to the
        origin of ``credentials_for`` (default: ``url``)."""
        origin = _origin(credentials_for or url)
        for _ in range(MAX_REDIRECTS + 1):
            self.check_deadline()
            address = self.destination(url)
            sent = dict(headers)
            if _origin(url) != origin:
                sent.pop("Authorization", None)
            sent["Host"] = url.netloc.decode("ascii")
            pinned = url.copy_with(host=address.split("%", 1)[0])
            client = self._client(url.host)
            request = client.build_request("GET", pinned, headers=sent, extensions={"sni_hostname": url.host})
            response = client.send(request, stream=True)
            location = response.headers.get("location")
            if response.status_code not in REDIRECTS or not location:
                return response, url
            response.close()
            try:
                url = url.join(location)
            except httpx.InvalidURL:
                raise Refused(f"{url.host}: a redirect to an invalid URL") from None
        raise Refused(f"more than {MAX_REDIRECTS} redirects")

    # ---- manifests -----------------------------------------------------------

    def resolve(self, ref: references.Reference) -> Manifest:
        """The manifest ``ref`` names, for this machine's platform."""
        wanted = ref.digest or ref.tag or "latest"
        body, media_type, digest = self._manifest(ref, wanted)
        document = _json(body, f"the manifest of {ref}")
        media_type = media_type or str(document.get("mediaType") or "")
        if media_type in INDEX_TYPES or (not media_type and "manifests" in document):
            chosen = pick_platform(document, ref)
            body, media_type, digest = self._manifest(ref, chosen)
            document = _json(body, f"the manifest of {ref}")
            media_type = media_type or str(document.get("mediaType") or "")
        if document.get("schemaVersion") == 1 or "signatures" in document:
            raise PullError(f"{ref} is a Docker schema 1 image, which registries stopped serving; rebuild it")
        if media_type and media_type not in MANIFEST_TYPES:
            raise PullError(f"{ref}: unsupported manifest type {media_type!r}")
        config, layers = document.get("config"), document.get("layers")
        if not isinstance(config, dict) or not isinstance(layers, list):
            raise PullError(f"{ref}: the manifest has no config or no layers")
        return Manifest(digest, media_type or MANIFEST_TYPES[0], config, layers, body)

    def _manifest(self, ref: references.Reference, wanted: str) -> tuple[bytes, str, str]:
        url = f"/v2/{ref.repository}/manifests/{wanted}"
        with self._get(ref, url, accept=ACCEPT, what=f"image {ref}") as response:
            body = _read_capped(response, MANIFEST_MAX, f"the manifest of {ref}", self.check_deadline)
            media_type = response.headers.get("content-type", "").split(";")[0].strip()
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        if references.DIGEST.fullmatch(wanted) and digest != wanted:
            raise PullError(f"{ref}: the registry sent a manifest whose digest is {digest}, not {wanted}")
        if media_type not in (*INDEX_TYPES, *MANIFEST_TYPES):
            media_type = ""
        return body, media_type, digest

    # ---- blobs -----------------------------------------------------------------

    def blob_json(self, ref: references.Reference, descriptor: dict[str, Any]) -> Any:
        digest, size = descriptor_of(descriptor)
        with self._get(
            ref, f"/v2/{ref.repository}/blobs/{digest}", what=f"blob {digest} of {ref}"
        ) as response:
            body = _read_capped(response, MANIFEST_MAX, f"the config of {ref}", self.check_deadline)
        check(body_digest(body), len(body), digest, size, f"the config of {ref}")
        return _json(body, f"the config of {ref}")

    def fetch_blob(
        self,
        ref: references.Reference,
        descriptor: dict[str, Any],
        dest: Path,
        progress: Callable[[int], None] | None = None,
        max_bytes: int | None = None,
    ) -> int:
        """Stream the blob to ``dest`` (overwritten), checking size and digest; its size."""
        digest, size = descriptor_of(descriptor)
        limit = max_bytes if size is None else size
        for attempt in range(ATTEMPTS):
            hasher, written = hashlib.sha256(), 0
            try:
                with (
                    self._get(
                        ref, f"/v2/{ref.repository}/blobs/{digest}", what=f"layer {digest} of {ref}"
                    ) as response,
                    dest.open("wb") as out,
                ):
                    for chunk in response.iter_raw():  # (never decoded: see _read_capped)
                        self.check_deadline()
                        written += len(chunk)
                        if limit is not None and written > limit:
                            raise PullError(f"layer {digest} of {ref} is larger than {limit} bytes")
                        hasher.update(chunk)
                        out.write(chunk)
                        if progress is not None:
                            progress(len(chunk))
            except httpx.TransportError as exc:  # cut mid-body: start the blob again
                if progress is not None:
                    progress(-written)
                if attempt + 1 == ATTEMPTS:
                    raise errors.Unavailable(f"downloading layer {digest} of {ref} failed: {exc}") from None
                time.sleep(BACKOFF * 2**attempt)
                continue
            check("sha256:" + hasher.hexdigest(), written, digest, size, f"layer {digest} of {ref}")
            return written
        raise AssertionError("unreachable")

    # ---- HTTP with auth, mirrors and retries -------------------------------------------

    def _get(
        self, ref: references.Reference, path: str, *, what: str, accept: str | None = None
    ) -> contextlib.closing[httpx.Response]:
        """An open (streamed) ``200`` answer: from the first mirror that has it, else the registry."""
        hosts = [*self.config.mirrors_for(ref.domain), ref.api_host]
        for host in hosts[:-1]:
            with contextlib.suppress(errors.Unavailable, errors.NotFound, PullError, errors.InvalidInput):
                return contextlib.closing(self._request(host, ref, path, accept=accept, what=what))
        return contextlib.closing(self._request(hosts[-1], ref, path, accept=accept, what=what))

    def _url(self, host: str, url: str) -> httpx.URL:
        try:
            return httpx.URL(url)
        except httpx.InvalidURL as exc:  # (an IPv6 literal the grammar takes, no URL can hold)
            raise PullError(
                f"registry {host} is not a usable address ({exc}): check the image reference"
            ) from None

    def _request(
        self, host: str, ref: references.Reference, path: str, *, accept: str | None, what: str
    ) -> httpx.Response:
        scope = f"repository:{ref.repository}:pull"
        authorized = False
        attempt = 0
        while True:
            headers = {"Accept": accept} if accept else {}
            if token := self._tokens.get((host, scope)):
                headers["Authorization"] = token
            url = self._url(host, f"{self._scheme(host)}://{host}{path}")
            try:
                response, answered = self._send(url, headers)
            except (httpx.TransportError, Refused) as exc:
                if isinstance(exc, httpx.TransportError) and self._fall_back_to_http(host, exc):
                    continue
                attempt += 1
                if attempt >= ATTEMPTS:
                    raise self._unreachable(host, exc) from None
                time.sleep(BACKOFF * 2 ** (attempt - 1))
                continue
            if response.status_code == 200:
                return response
            if response.status_code not in (401, 429) and response.status_code < 500:
                refusal = _refusal(host, what, response)
                response.close()
                raise refusal
            response.close()
            if response.status_code == 401 and not authorized and _origin(answered) == _origin(url):
                authorized = True  # (only the registry's own challenge: never one a redirect's target sets)
                self._authorize(host, ref, response.headers.get("www-authenticate", ""), scope)
                continue
            if response.status_code == 429 or response.status_code >= 500:
                attempt += 1
                if attempt >= ATTEMPTS:
                    raise errors.Unavailable(f"registry {host} answered {response.status_code} for {what}")
                time.sleep(BACKOFF * 2 ** (attempt - 1))
                continue
            raise _refusal(host, what, response)  # a second 401: the credentials are not enough

    def _unreachable(self, host: str, exc: BaseException) -> errors.Unavailable:
        """The one error for a registry that cannot be reached; the reason goes to the log."""
        log.warning("image.registry_unreachable", registry=host, reason=_reason(exc))
        return errors.Unavailable(UNREACHABLE.format(host=host))

    def _scheme(self, host: str) -> str:
        return self._schemes.get(host, "https")

    def _fall_back_to_http(self, host: str, exc: httpx.TransportError) -> bool:
        """A registry listed as insecure that does not speak TLS is asked over HTTP."""
        if self._scheme(host) == "http" or not self.config.allows_http(host):
            return False
        if not isinstance(exc, httpx.ConnectError | httpx.RemoteProtocolError | httpx.ReadError):
            return False
        with self._lock:
            self._schemes[host] = "http"
        return True

    def _authorize(self, host: str, ref: references.Reference, challenge: str, scope: str) -> None:
        scheme, _, params = challenge.partition(" ")
        credentials = self.config.credentials_for(ref.domain if host == ref.api_host else host)
        if scheme.lower() == "basic":
            if credentials is None:
                raise errors.InvalidInput(
                    f"registry {host} needs credentials for {ref}: add them to the registry "
                    "configuration (SBX_REGISTRIES_FILE)"
                )
            self._tokens[(host, scope)] = basic_header(*credentials)
            return
        if scheme.lower() != "bearer":
            raise PullError(f"registry {host} asks for an unsupported authentication ({scheme or 'none'})")
        fields = dict(_CHALLENGE.findall(params))
        realm = fields.get("realm", "")
        try:
            realm_url = httpx.URL(realm) if realm else None
        except httpx.InvalidURL:
            realm_url = None
        if realm_url is None or realm_url.scheme not in ("https", "http") or not realm_url.host:
            raise PullError(f"registry {host} sent a token challenge without a usable realm")
        query = {"scope": fields.get("scope") or scope}
        if service := fields.get("service"):
            query["service"] = service
        headers = {"Authorization": basic_header(*credentials)} if credentials else {}
        try:
            answer, _ = self._send(realm_url.copy_merge_params(query), headers, credentials_for=realm_url)
            body = _read_capped(answer, MANIFEST_MAX, f"the token of {host}", self.check_deadline)
            answer.close()
        except (httpx.TransportError, Refused) as exc:
            raise self._unreachable(host, exc) from None
        if answer.status_code in (401, 403):
            raise errors.InvalidInput(
                f"registry {host} refused access to {ref}"
                + ("" if credentials else " without credentials: add them to SBX_REGISTRIES_FILE")
            )
        if answer.status_code != 200:
            raise errors.Unavailable(f"the token service of {host} answered {answer.status_code}")
        try:
            document = json.loads(body)
            token = document.get("token") or document.get("access_token")
        except (ValueError, AttributeError, RecursionError):
            token = None
        if not isinstance(token, str) or not token:
            raise PullError(f"the token service of {host} sent no token")
        self._tokens[(host, scope)] = f"Bearer {token}"


# ---- helpers (pure) ---------------------------------------------------------------


def pick_platform(index: dict[str, Any], ref: references.Reference) -> str:
    """The digest of the manifest for this machine in an image index."""
    manifests = index.get("manifests")
    if not isinstance(manifests, list) or not manifests:
        raise PullError(f"{ref}: the image index lists no manifests")
    want_os, want_arch = machine_platform()
    offered = []
    for entry in manifests:
        plat = entry.get("platform") if isinstance(entry, dict) else None
        if not isinstance(plat, dict):
            continue
        offered.append(f"{plat.get('os')}/{plat.get('architecture')}")
        if plat.get("os") == want_os and plat.get("architecture") == want_arch:
            digest, _ = descriptor_of(entry)
            return digest
    raise PullError(
        f"{ref} has no image for {want_os}/{want_arch} (it has {', '.join(offered) or 'no platforms'})"
    )


def descriptor_of(descriptor: Any) -> tuple[str, int | None]:
    if not isinstance(descriptor, dict):
        raise PullError("an OCI descriptor is not a JSON object")
    digest, size = descriptor.get("digest"), descriptor.get("size")
    if not isinstance(digest, str) or not references.DIGEST.fullmatch(digest):
        raise PullError(f"unsupported or invalid digest {digest!r} (sha256 only)")
    if size is not None and (not isinstance(size, int) or size < 0):
        raise PullError(f"invalid size {size!r} for {digest}")
    return digest, size


def basic_header(username: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{username}:{password}".encode()).decode()


def body_digest(body: bytes) -> str:
    return "sha256:" + hashlib.sha256(body).hexdigest()


def check(actual: str, actual_size: int, digest: str, size: int | None, what: str) -> None:
    if actual != digest:
        raise PullError(
            f"{what} does not match its digest (got {actual}): the registry or the network altered it"
        )
    if size is not None and size != actual_size:
        raise PullError(f"{what} is {actual_size} bytes, its descriptor says {size}")


def _json(body: bytes, what: str) -> Any:
    try:
        document = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise PullError(f"{what} is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(document, dict):
        raise PullError(f"{what} is not a JSON object")
    return document


def _read_capped(response: httpx.Response, limit: int, what: str, check: Callable[[], None]) -> bytes:
    """The answer's body as sent, at most ``limit`` bytes. Never decoded: a ``Content-Encoding``
    (we ask for ``identity``) would have httpx inflate it without bound before any cap
    (1.8 KB of stacked gzip is 1 GiB); an encoded answer then fails its digest or parse."""
    out = bytearray()
    try:
        for chunk in response.iter_raw():
            check()
            out += chunk
            if len(out) > limit:
                raise PullError(f"{what} is larger than {limit} bytes")
    except httpx.TransportError:
        check()  # (shut down by the pull's watchdog: its deadline is the reason)
        raise
    return bytes(out)


def _refusal(host: str, what: str, response: httpx.Response) -> errors.SandboxError:
    """The registry's own reason (its ``errors[].message``), never our request's headers."""
    reason = ""
    with contextlib.suppress(Exception):
        response.read()
        body = response.json()
        reason = "; ".join(str(e.get("message") or e.get("code")) for e in body.get("errors", [])[:3])
    said = f": {reason[:300]}" if reason else ""
    status = response.status_code
    if status == 404:
        return errors.NotFound(f"registry {host} has no {what}{said}")
    if status in (401, 403):
        return errors.InvalidInput(f"registry {host} refused {what} ({status}){said}")
    return PullError(f"registry {host} answered {status} for {what}{said}")


def _origin(url: httpx.URL) -> tuple[str, str, int | None]:
    return url.scheme, url.host, url.port


def _reason(exc: BaseException) -> str:
    return str(exc)[:200] or type(exc).__name__
