"""gateway: the only HTTP surface (REST, MCP at ``/mcp``, the host API). Stateless.

It authenticates every call, validates input, turns writes into commands sent
over NATS to the scheduler and tool calls into requests to the executor, and answers
reads from the KV projections.
"""
