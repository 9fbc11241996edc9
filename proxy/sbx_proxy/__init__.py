"""The credential proxy: a mitmproxy addon that injects credentials in flight for
configured hosts, checks every destination after DNS resolution, and tunnels everything
else untouched. Runs in its own environment (``proxy/.venv``); everything here except
``addon.py`` and ``cli.py`` is plain Python, importable and tested without mitmproxy."""
