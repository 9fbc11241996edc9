"""executor: runs commands inside sandboxes: the persistent shell, async jobs, file edits.

All per-session state lives inside the sandbox (``scripts``), so any instance can
serve any session and a killed executor loses nothing. ``edits`` and ``output`` are
pure; ``handlers`` is the glue; ``app`` wires it.
"""
