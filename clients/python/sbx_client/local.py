"""Finding a local ``sbx up`` from this host: its state directory, and there the gateway's
URL (``stack.json``) and the API key (``api-key``). ``sbx up`` writes both (``sbx.stack``
uses these names); an agent host with only this package reads them."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

DEFAULT_STATE_DIR = ".sbx"
STACK_FILE = "stack.json"
API_KEY_FILE = "api-key"


def state_dir(option: Path | None, env: Mapping[str, str]) -> Path:
    """``option``, else ``SBX_STATE_DIR``, else ``.sbx`` (relative to where we are)."""
    return option or Path(env.get("SBX_STATE_DIR", DEFAULT_STATE_DIR))


def gateway_url(directory: Path) -> str | None:
    """The URL a running ``sbx up`` of that state dir serves on (None: none known)."""
    try:
        url = json.loads((directory / STACK_FILE).read_text()).get("gateway_url")
    except (OSError, ValueError, AttributeError):
        return None
    return url if isinstance(url, str) and url else None


def api_key(directory: Path) -> str | None:
    try:
        return (directory / API_KEY_FILE).read_text().strip() or None
    except OSError:
        return None
