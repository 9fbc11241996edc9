"""What a tenant may keep on a session besides its id: labels (``metadata``) and the
environment of the commands run in it (``env``). Bounded, and checked wherever a command
carrying them is decided, so no stored event holds more than these limits allow."""

from __future__ import annotations

import re

from sbx_api import errors

MAX_ENTRIES = 64
MAX_KEY = 128
MAX_VALUE = 1024
MAX_ENV_VALUE = 8192
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def validate_metadata(value: dict[str, str]) -> dict[str, str]:
    """Labels: at most 64, keys 1 to 128 and values up to 1024 characters, no control characters."""
    if len(value) > MAX_ENTRIES:
        raise errors.InvalidInput(f"metadata has {len(value)} entries; at most {MAX_ENTRIES}")
    for key, item in value.items():
        if not 1 <= len(key) <= MAX_KEY or _CONTROL.search(key):
            raise errors.InvalidInput(
                f"metadata keys are 1 to {MAX_KEY} characters without control characters"
            )
        if len(item) > MAX_VALUE or _CONTROL.search(item):
            raise errors.InvalidInput(
                f"metadata value of {key!r} is longer than {MAX_VALUE} characters or has control characters"
            )
    return value


def validate_env(value: dict[str, str]) -> dict[str, str]:
    """Environment variables: at most 64, names as a shell's, values without NUL."""
    if len(value) > MAX_ENTRIES:
        raise errors.InvalidInput(f"envVars has {len(value)} entries; at most {MAX_ENTRIES}")
    for name, item in value.items():
        if not _ENV_NAME.fullmatch(name):
            raise errors.InvalidInput(
                f"environment variable name {name[:64]!r} is not a shell name (letters, digits, '_')"
            )
        if len(item) > MAX_ENV_VALUE or "\x00" in item:
            raise errors.InvalidInput(
                f"environment variable {name} is longer than {MAX_ENV_VALUE} characters or holds NUL"
            )
    return value
