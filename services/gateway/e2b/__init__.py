"""The E2B-compatible control plane: what the ``e2b`` SDK calls (``E2B_API_URL``), served
by the gateway under ``/e2b`` and mapped onto the session commands. See docs/e2b.md."""
