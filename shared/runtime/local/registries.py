"""The operator's registry configuration: credentials, insecure registries and mirrors.

One TOML file, named by ``SBX_REGISTRIES_FILE`` (readable by the services only; nothing
of it reaches a sandbox, an event or a log)::

    [registries."ghcr.io"]
    username = "ci-bot"
    password_file = "/run/secrets/ghcr-token"   # or: password = "..."

    [registries."registry.internal:5000"]
    insecure = true                              # plain HTTP allowed

    [registries."docker.io"]
    mirrors = ["mirror.internal:5000"]           # tried first, in order

    [registries."auth.internal"]                 # named, nothing else: may be on a
                                                 # private address (a token service)

It is also the puller's egress allow-list. A reference is a tenant's choice, so the
puller reaches only public addresses (``shared/domain/destinations.py``), except the
hosts named here: each ``[registries."HOST[:PORT]"]`` table and each mirror may be on
any address (loopback, private). Plain HTTP only to the ones marked ``insecure``. A host
matches as written: with a port, that port only; without one, the scheme's default port.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from sbx_api import errors
from shared.contract import references


@dataclass(frozen=True)
class Registry:
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    insecure: bool = False
    mirrors: tuple[str, ...] = ()


@dataclass(frozen=True)
class RegistryConfig:
    registries: dict[str, Registry] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path | None) -> RegistryConfig:
        if path is None:
            return cls()
        try:
            raw = tomllib.loads(path.read_text())
        except OSError as exc:
            raise errors.ConfigError(f"SBX_REGISTRIES_FILE {path}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise errors.ConfigError(f"SBX_REGISTRIES_FILE {path} is not valid TOML: {exc}") from None
        table = raw.get("registries", {})
        unknown = set(raw) - {"registries"}
        if unknown or not isinstance(table, dict):
            raise errors.ConfigError(f'SBX_REGISTRIES_FILE {path}: only [registries."HOST"] tables are known')
        out = {}
        for host, entry in table.items():
            out[_host(host)] = _entry(path, host, entry)
        return cls(out)

    def _get(self, host: str) -> Registry:
        return self.registries.get(host) or Registry()

    def credentials_for(self, host: str) -> tuple[str, str] | None:
        entry = self._get(host)
        if entry.username is None or entry.password is None:
            return None
        return entry.username, entry.password

    def allows_http(self, host: str) -> bool:
        """Whether ``host`` (``name[:port]``, as in a reference) may be asked over plain HTTP."""
        return self._get(host).insecure

    def names(self, host: str, port: int, scheme: str) -> bool:
        """Whether the operator named the destination ``host``:``port`` (reached over
        ``scheme``): a registry's table or a mirror. Named destinations may be on any
        address; every other one only on public addresses."""
        wanted = _host(host.strip("[]"))
        default = 443 if scheme == "https" else 80
        for name in (*self.registries, *(m for entry in self.registries.values() for m in entry.mirrors)):
            listed, listed_port = _split(name)
            if listed == wanted and (listed_port or default) == port:
                return True
        return False

    def insecure(self, host: str, port: int) -> bool:
        """Whether plain HTTP may go to ``host``:``port`` (an ``insecure`` entry names it)."""
        wanted = _host(host.strip("[]"))
        for name, entry in self.registries.items():
            listed, listed_port = _split(name)
            if entry.insecure and listed == wanted and (listed_port or 80) == port:
                return True
        return False

    def mirrors_for(self, host: str) -> tuple[str, ...]:
        return self._get(host).mirrors


def _split(name: str) -> tuple[str, int | None]:
    """``host[:port]`` (an IPv6 literal in brackets) as its host and port."""
    host, port = name, ""
    if name.startswith("[") and "]" in name:
        host, _, rest = name[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif name.count(":") == 1:
        host, port = name.split(":")
    return _host(host), int(port) if port.isdigit() else None


def _host(host: str) -> str:
    host = host.strip().lower()
    if host in ("index.docker.io", references.DOCKER_HUB_API):
        return references.DOCKER_HUB
    return host


def _entry(path: Path, host: str, entry: object) -> Registry:
    where = f"SBX_REGISTRIES_FILE {path}, registry {host!r}"
    if not isinstance(entry, dict):
        raise errors.ConfigError(f"{where}: must be a table")
    unknown = set(entry) - {"username", "password", "password_file", "insecure", "mirrors"}
    if unknown:
        raise errors.ConfigError(f"{where}: unknown keys {', '.join(sorted(unknown))}")
    password = entry.get("password")
    if "password_file" in entry:
        try:
            password = Path(str(entry["password_file"])).read_text().strip()
        except OSError as exc:
            raise errors.ConfigError(f"{where}: password_file: {exc.strerror}") from None
    username = entry.get("username")
    if (username is None) != (password is None):
        raise errors.ConfigError(f"{where}: give both a username and a password (or password_file)")
    mirrors = entry.get("mirrors", [])
    if not isinstance(mirrors, list) or not all(isinstance(m, str) and m for m in mirrors):
        raise errors.ConfigError(f"{where}: mirrors must be a list of registry hosts")
    return Registry(
        username=None if username is None else str(username),
        password=None if password is None else str(password),
        insecure=bool(entry.get("insecure", False)),
        mirrors=tuple(m.strip().lower() for m in mirrors),
    )
