"""The domain: one module per aggregate, with its state fold and the pure rules that
decide its events, plus the warm-pool rules. No I/O; imports only the contract."""
