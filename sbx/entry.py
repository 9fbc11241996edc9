"""The ``sbx`` console script. ``sbx exec``, ``sbx release`` and ``sbx route`` (the
agent-host client's commands, :mod:`sbx_client.cli`) run once per agent tool call, so they
start without the rest of the CLI (NATS, the stack's modules)."""

from __future__ import annotations

import sys

HOST_COMMANDS = ("exec", "release", "route")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in HOST_COMMANDS:
        from sbx_client import cli

        cli.main(prog="sbx")
        return
    from sbx.cli import app

    app()
