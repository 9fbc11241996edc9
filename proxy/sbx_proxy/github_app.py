"""GitHub App installation tokens: a JWT signed with the app's private key (RS256) buys
an installation token, cached until shortly before it expires.

https://docs.github.com/en/apps/creating-github-apps/authenticating-with-a-github-app
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from datetime import datetime

import jwt

REFRESH_MARGIN = 300.0
"""Mint a new token this many seconds before the current one expires."""
JWT_LIFETIME = 540
"""GitHub accepts at most 10 minutes; the issue time is back-dated 60 s for clock drift."""


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None  # a 3xx answer becomes an HTTPError


class MintError(RuntimeError):
    """GitHub refused or could not be reached; the message never contains a token."""


class InstallationTokens:
    def __init__(
        self,
        *,
        app_id: int,
        installation_id: int,
        private_key: str,
        api_url: str = "https://api.github.com",
        repositories: tuple[str, ...] = (),
        permissions: dict[str, str] | None = None,
        ca_file: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.app_id, self.installation_id = app_id, installation_id
        self._key = private_key
        self.api_url = api_url.rstrip("/")
        self.repositories, self.permissions = repositories, dict(permissions or {})
        self._ssl = ssl.create_default_context(cafile=ca_file)
        # No redirects: a redirected POST would carry the app's JWT to another host.
        self._opener = urllib.request.build_opener(
            _NoRedirects(), urllib.request.HTTPSHandler(context=self._ssl)
        )
        self.clock = clock
        self._token: str | None = None
        self._expires = 0.0
        self._lock = asyncio.Lock()
        self.minted = 0

    def app_jwt(self) -> str:
        now = int(self.clock())
        claims = {"iat": now - 60, "exp": now + JWT_LIFETIME, "iss": str(self.app_id)}
        return jwt.encode(claims, self._key, algorithm="RS256")

    async def token(self) -> str:
        async with self._lock:
            if self._token is None or self.clock() >= self._expires - REFRESH_MARGIN:
                self._token, self._expires = await asyncio.to_thread(self._mint)
                self.minted += 1
            assert self._token is not None
            return self._token

    def _mint(self) -> tuple[str, float]:
        body: dict[str, object] = {}
        if self.repositories:
            body["repositories"] = list(self.repositories)
        if self.permissions:
            body["permissions"] = self.permissions
        request = urllib.request.Request(  # noqa: S310 - api_url is checked to be https://
            f"{self.api_url}/app/installations/{self.installation_id}/access_tokens",
            data=json.dumps(body).encode(),
            method="POST",
            headers={
                "Authorization": f"Bearer {self.app_jwt()}",
                "Accept": "application/vnd.github+json",
                "X-GitHub-Api-Version": "2022-11-28",
                "User-Agent": "cloud-agent-sandbox-proxy",
            },
        )
        try:
            with self._opener.open(request, timeout=15) as response:
                answer = json.loads(response.read())
        except urllib.error.HTTPError as exc:
            raise MintError(f"GitHub refused the installation token: HTTP {exc.code}") from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise MintError(f"cannot mint an installation token: {type(exc).__name__}") from None
        token, expires = answer.get("token"), answer.get("expires_at")
        if not isinstance(token, str) or not token or not isinstance(expires, str):
            raise MintError("GitHub's answer has no token or expiry")
        try:
            expiry = datetime.fromisoformat(expires.replace("Z", "+00:00")).timestamp()
        except ValueError:
            raise MintError("GitHub's expires_at is not a timestamp") from None
        return token, expiry
