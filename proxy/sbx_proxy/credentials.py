"""What each rule adds to a request: header values, and the secrets to keep out of
responses and logs."""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import re
from dataclasses import dataclass
from types import ModuleType

from sbx_proxy import config, github_app

_GIT_PATH = re.compile(r"(/info/refs|/git-upload-pack|/git-receive-pack|/info/lfs(/.*)?)$")


def is_git(path: str, query: str) -> bool:
    """A git smart-HTTP (or LFS) request: these authenticate with basic auth."""
    if path.endswith("/info/refs"):
        return "service=git-" in query
    return bool(_GIT_PATH.search(path))


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


@dataclass(frozen=True)
class Injection:
    headers: dict[str, str]
    secrets: tuple[str, ...]
    """Every string that must never reach the sandbox (the token and whole header values)."""


class Provider:
    """Credentials for one rule."""

    def __init__(self, rule: config.Rule) -> None:
        self.rule = rule
        self._tokens: github_app.InstallationTokens | None = None
        self._hook: ModuleType | None = None
        if rule.kind == "github_app":
            assert rule.private_key and rule.app_id and rule.installation_id
            self._tokens = github_app.InstallationTokens(
                app_id=rule.app_id,
                installation_id=rule.installation_id,
                private_key=rule.private_key,
                api_url=rule.api_url,
                repositories=rule.repositories,
                permissions=rule.permissions,
                ca_file=rule.api_ca_file,
            )
        elif rule.kind == "hook":
            assert rule.hook_file
            spec = importlib.util.spec_from_file_location(f"sbx_proxy_hook_{rule.name}", rule.hook_file)
            if spec is None or spec.loader is None:
                raise config.ConfigError(f"rule {rule.name}: cannot load {rule.hook_file}")
            module = importlib.util.module_from_spec(spec)
            try:
                spec.loader.exec_module(module)
            except Exception as exc:
                raise config.ConfigError(
                    f"rule {rule.name}: {rule.hook_file} failed to load: {exc!r}"
                ) from None
            if not callable(getattr(module, "credentials", None)):
                raise config.ConfigError(
                    f"rule {rule.name}: {rule.hook_file} defines no credentials() function"
                )
            self._hook = module

    async def injection(self, host: str, method: str, path: str, query: str) -> Injection | None:
        rule = self.rule
        git = is_git(path, query)
        match rule.kind:
            case "bearer":
                assert rule.token
                return _headers({"Authorization": f"Bearer {rule.token}"}, rule.token)
            case "basic":
                assert rule.username and rule.password
                return _headers({"Authorization": basic(rule.username, rule.password)}, rule.password)
            case "gitlab":
                assert rule.token
                value = basic("oauth2", rule.token) if git else f"Bearer {rule.token}"
                return _headers({"Authorization": value}, rule.token)
            case "github_app":
                assert self._tokens is not None
                token = await self._tokens.token()
                value = basic("x-access-token", token) if git else f"Bearer {token}"
                return _headers({"Authorization": value}, token)
            case "hook":
                assert self._hook is not None
                answer = await asyncio.to_thread(self._hook.credentials, host, method, path)
                if answer is None:
                    return None
                if not isinstance(answer, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) and "\n" not in k + v and "\r" not in k + v
                    for k, v in answer.items()
                ):
                    raise ValueError("the hook must return a dict of header name -> value, or None")
                return _headers(answer)
        raise AssertionError(rule.kind)


def _headers(headers: dict[str, str], *secrets: str) -> Injection:
    values = [v for v in headers.values() if len(v) >= 8]
    for v in headers.values():  # the credential part of "Bearer X" / "Basic X" on its own too
        scheme, _, rest = v.partition(" ")
        if rest and scheme in ("Bearer", "Basic", "token") and len(rest) >= 8:
            values.append(rest)
    return Injection(headers, tuple(dict.fromkeys([*secrets, *values])))
