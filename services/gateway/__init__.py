"""gateway: the REST (and, later, MCP) surface. Stateless.

It authenticates every call, validates input, turns writes into commands sent
over NATS to the scheduler, and answers reads from the KV projections.
"""
