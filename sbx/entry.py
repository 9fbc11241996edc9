"""The ``sbx`` console script. ``sbx exec`` and ``sbx release`` run once per agent tool
call, so they start without the rest of the CLI (typer, NATS): ~70 ms of imports
instead of ~300."""

from __future__ import annotations

import sys


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("exec", "release"):
        from sbx.client import cli

        raise SystemExit(cli.main(sys.argv[1:]))
    from sbx.cli import app

    app()
