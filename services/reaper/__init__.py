"""reaper: lifetimes and the self-healing sweep.

Running sessions are stopped after ``SBX_MAX_LIFETIME`` or ``SBX_IDLE_TIMEOUT`` without a
tool call; stopped ones are purged after ``SBX_STOPPED_RETENTION`` or beyond
``SBX_MAX_STOPPED``. The sweep deletes runtime sandboxes that have no live record and
records ``sandbox.lost`` for records whose sandbox vanished. ``logic`` is pure (fake
time in tests); ``handlers`` carries it out; one instance at a time holds the lease.
"""
