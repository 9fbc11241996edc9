"""Code every service shares, in layers whose names say what they hold:

* ``shared.contract``: what crosses the wire (events, commands, states, subjects, errors,
  the codec, id rules). Imports nothing else of the product.
* ``shared.domain``: one module per aggregate with its fold and the pure rules that decide
  its events. Imports only the contract.
* ``shared.infrastructure``: NATS and process plumbing (bus, event store, projections in
  KV, leases, streams, the service runner, metrics, health, settings).
* ``shared.runtime``: the sandbox runtime API and its backends (bubblewrap, Kubernetes).

Services import from here, never from each other. The direction is enforced by the
import-linter contracts in pyproject.toml.
"""
