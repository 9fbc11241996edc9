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

Loopback registries (``localhost``, ``127.*``, ``[::1]``) may always use plain HTTP.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from shared.contract import errors, references


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
        return references.is_loopback(host) or self._get(host).insecure

    def mirrors_for(self, host: str) -> tuple[str, ...]:
        return self._get(host).mirrors


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
