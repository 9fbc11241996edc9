"""The infrastructure: NATS and process plumbing. The bus, the event store, projections
and followed copies, leases, streams, the service runner, metrics, health, logs and
settings."""
