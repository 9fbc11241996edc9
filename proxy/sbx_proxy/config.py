"""The proxy's configuration: a TOML file mapping hosts to credential rules.

    [destinations]
    allow_private = false            # refuse private, loopback, link-local ranges (default)
    allow = ["10.20.0.0/16"]         # networks always allowed (an internal git server)

    [[rules]]
    name = "github"                  # shown in logs (never a secret)
    hosts = ["github.com", "api.github.com"]
    kind = "github_app"              # github_app | gitlab | bearer | basic | hook
    app_id = 123456
    installation_id = 7890123
    private_key_file = "/etc/sbx-proxy/github-app.pem"
    repositories = ["my-repo"]       # optional: narrow the token
    permissions = { contents = "write", pull_requests = "write" }

Secrets are given as ``token_file``/``token_env`` (or ``token`` inline, discouraged),
``password_file``/``password_env``/``password``. Every error names the field at fault.
Without a config file the proxy injects nothing and tunnels everything.
"""

from __future__ import annotations

import ipaddress
import os
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sbx_proxy import destinations, egress, hosts

KINDS = ("github_app", "gitlab", "bearer", "basic", "hook")
DEFAULT_GITHUB_API = "https://api.github.com"


class ConfigError(ValueError):
    """The configuration cannot be used; the message says where and why."""


@dataclass(frozen=True)
class Rule:
    name: str
    kind: str
    hosts: tuple[tuple[str, int], ...]
    token: str | None = None
    username: str | None = None
    password: str | None = None
    app_id: int | None = None
    installation_id: int | None = None
    private_key: str | None = None
    api_url: str = DEFAULT_GITHUB_API
    api_ca_file: str | None = None
    repositories: tuple[str, ...] = ()
    permissions: dict[str, str] = field(default_factory=dict)
    hook_file: str | None = None

    def __repr__(self) -> str:  # never print secrets
        return f"Rule(name={self.name!r}, kind={self.kind!r}, hosts={self.hosts!r})"


@dataclass(frozen=True)
class Config:
    rules: tuple[Rule, ...] = ()
    allow_private: bool = False
    allow: tuple[destinations.Network, ...] = ()
    env_names: tuple[str, ...] = ()
    """The environment variables the secrets come from (``*_env`` fields): what the
    process that starts a proxy must hand it, and nothing else."""

    @property
    def configured(self) -> frozenset[tuple[str, int]]:
        return frozenset(h for rule in self.rules for h in rule.hosts)

    def rule_for(self, host: str | None, port: int) -> Rule | None:
        name = hosts.normalize(host)
        for rule in self.rules:
            if (name, port) in rule.hosts:
                return rule
        return None

    def refusal(self, address: str) -> egress.Refusal | None:
        return destinations.refusal(address, allow_private=self.allow_private, allow=self.allow)


def _secret(
    table: dict[str, Any],
    key: str,
    where: str,
    env: dict[str, str],
    *,
    required: bool,
    multiline: bool = False,
) -> str | None:
    given = [k for k in (key, f"{key}_file", f"{key}_env") if k in table]
    if len(given) > 1:
        raise ConfigError(f"{where}: give only one of {', '.join(given)}")
    if not given:
        if required:
            raise ConfigError(f"{where}: needs {key}_file or {key}_env (or {key})")
        return None
    source = given[0]
    raw = table[source]
    if not isinstance(raw, str) or not raw:
        raise ConfigError(f"{where}.{source}: must be a non-empty string")
    if source.endswith("_file"):
        try:
            value = Path(raw).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"{where}.{source}: cannot read {raw}: {exc.strerror}") from None
    elif source.endswith("_env"):
        value = env.get(raw, "").strip()
        if not value:
            raise ConfigError(f"{where}.{source}: environment variable {raw} is not set")
    else:
        value = raw
    if not value or "\0" in value or (not multiline and any(c in value for c in "\r\n")):
        raise ConfigError(f"{where}.{source}: the secret is empty or contains line breaks")
    return value


def _hosts(raw: object, where: str) -> tuple[tuple[str, int], ...]:
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"{where}.hosts: a non-empty list of host names is required")
    out = []
    for item in raw:
        split = hosts.split_authority(item, 443) if isinstance(item, str) else None
        name = hosts.normalize(split[0]) if split else None
        if split is None or name is None or name != split[0]:
            raise ConfigError(
                f"{where}.hosts: {item!r} is not a lower-case ASCII host name "
                "(IDNs in punycode; no trailing dot; optional :port)"
            )
        out.append((name, split[1]))
    return tuple(out)


_FIELDS = {
    "github_app": {"app_id", "installation_id", "private_key", "private_key_file", "private_key_env",
                   "api_url", "api_ca_file", "repositories", "permissions"},
    "gitlab": {"token", "token_file", "token_env"},
    "bearer": {"token", "token_file", "token_env"},
    "basic": {"username", "password", "password_file", "password_env"},
    "hook": {"file"},
}  # fmt: skip


def _rule(index: int, table: object, env: dict[str, str], seen: set[tuple[str, int]]) -> Rule:
    where = f"rules[{index}]"
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: must be a table")
    kind = table.get("kind")
    if kind not in KINDS:
        raise ConfigError(f"{where}.kind: must be one of {', '.join(KINDS)} (got {kind!r})")
    unknown = set(table) - {"name", "kind", "hosts"} - _FIELDS[kind]
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) for kind {kind}: {', '.join(sorted(unknown))}")
    rule_hosts = _hosts(table.get("hosts"), where)
    for h in rule_hosts:
        if h in seen:
            raise ConfigError(f"{where}.hosts: {h[0]}:{h[1]} already has a rule")
        seen.add(h)
    name = table.get("name", f"rule-{index}")
    if not isinstance(name, str):
        raise ConfigError(f"{where}.name: must be a string")
    common: dict[str, Any] = {"name": name, "kind": kind, "hosts": rule_hosts}
    return _KIND_RULES[kind](table, where, env, common)


def _token_rule(table: dict[str, Any], where: str, env: dict[str, str], common: dict[str, Any]) -> Rule:
    return Rule(**common, token=_secret(table, "token", where, env, required=True))


def _basic_rule(table: dict[str, Any], where: str, env: dict[str, str], common: dict[str, Any]) -> Rule:
    username = table.get("username")
    if not isinstance(username, str) or not username or ":" in username:
        raise ConfigError(f"{where}.username: a non-empty name without ':' is required")
    return Rule(**common, username=username, password=_secret(table, "password", where, env, required=True))


def _hook_rule(table: dict[str, Any], where: str, env: dict[str, str], common: dict[str, Any]) -> Rule:
    file = table.get("file")
    if not isinstance(file, str) or not Path(file).is_file():
        raise ConfigError(f"{where}.file: the hook's Python file does not exist ({file!r})")
    return Rule(**common, hook_file=file)


def _github_app_rule(table: dict[str, Any], where: str, env: dict[str, str], common: dict[str, Any]) -> Rule:
    ids: dict[str, int] = {}
    for name in ("app_id", "installation_id"):
        value = table.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{where}.{name}: a positive integer is required")
        ids[name] = value
    api_url = table.get("api_url", DEFAULT_GITHUB_API)
    if not isinstance(api_url, str) or not api_url.startswith("https://"):
        raise ConfigError(f"{where}.api_url: must be an https:// URL")
    repositories = table.get("repositories", [])
    if not isinstance(repositories, list) or not all(isinstance(r, str) and r for r in repositories):
        raise ConfigError(f"{where}.repositories: a list of repository names")
    permissions = table.get("permissions", {})
    if not isinstance(permissions, dict) or not all(
        isinstance(k, str) and v in ("read", "write", "admin") for k, v in permissions.items()
    ):
        raise ConfigError(f"{where}.permissions: a table of permission = read|write|admin")
    key = _secret(table, "private_key", where, env, required=True, multiline=True)
    assert key is not None
    if "PRIVATE KEY" not in key:
        raise ConfigError(f"{where}.private_key: not a PEM private key")
    ca = table.get("api_ca_file")
    if ca is not None and not (isinstance(ca, str) and Path(ca).is_file()):
        raise ConfigError(f"{where}.api_ca_file: no such file {ca!r}")
    return Rule(
        **common,
        app_id=ids["app_id"],
        installation_id=ids["installation_id"],
        private_key=key,
        api_url=api_url.rstrip("/"),
        api_ca_file=ca,
        repositories=tuple(repositories),
        permissions=dict(permissions),
    )


_KIND_RULES: dict[str, Callable[[dict[str, Any], str, dict[str, str], dict[str, Any]], Rule]] = {
    "gitlab": _token_rule,
    "bearer": _token_rule,
    "basic": _basic_rule,
    "hook": _hook_rule,
    "github_app": _github_app_rule,
}


def parse(data: dict[str, Any], env: dict[str, str] | None = None) -> Config:
    env = dict(os.environ if env is None else env)
    unknown = set(data) - {"rules", "destinations"}
    if unknown:
        raise ConfigError(f"unknown top-level key(s): {', '.join(sorted(unknown))}")
    dest = data.get("destinations", {})
    if not isinstance(dest, dict) or set(dest) - {"allow_private", "allow"}:
        raise ConfigError("destinations: only allow_private and allow are known")
    allow_private = dest.get("allow_private", False)
    if not isinstance(allow_private, bool):
        raise ConfigError("destinations.allow_private: true or false")
    allow = []
    for item in dest.get("allow", []):
        try:
            allow.append(ipaddress.ip_network(item, strict=False))
        except (TypeError, ValueError):
            raise ConfigError(f"destinations.allow: {item!r} is not a network (e.g. 10.0.0.0/8)") from None
    rules_raw = data.get("rules", [])
    if not isinstance(rules_raw, list):
        raise ConfigError("rules: must be an array of tables ([[rules]])")
    seen: set[tuple[str, int]] = set()
    rules = tuple(_rule(i, r, env, seen) for i, r in enumerate(rules_raw))
    names = sorted({v for table in rules_raw for k, v in table.items() if k.endswith("_env")})
    return Config(rules=rules, allow_private=allow_private, allow=tuple(allow), env_names=tuple(names))


def load(path: str | Path | None, env: dict[str, str] | None = None) -> Config:
    """The config at ``path``; the empty config (inject nothing) when no path is given."""
    if not path:
        return Config()
    try:
        data = tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read the proxy config {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None
    return parse(data, env)
