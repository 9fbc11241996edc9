"""Prints the newest `e2b` release on PyPI if it is newer than the one installed (the dev
extra's pin), else nothing: whether scripts/test runs scripts/e2b-newest. Any failure
(no network, no SDK installed) prints nothing and exits 0: the warning is best effort."""

from __future__ import annotations

import importlib.metadata
import json
import urllib.request

from packaging.version import InvalidVersion, Version


def main() -> None:
    try:
        pinned = Version(importlib.metadata.version("e2b"))
        with urllib.request.urlopen("https://pypi.org/pypi/e2b/json", timeout=10) as answer:
            newest = Version(json.loads(answer.read(4 * 1024 * 1024))["info"]["version"])
    except (OSError, ValueError, KeyError, InvalidVersion, importlib.metadata.PackageNotFoundError):
        return
    if newest > pinned:
        print(newest)


if __name__ == "__main__":
    main()
