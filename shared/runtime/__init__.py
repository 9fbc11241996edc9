"""The sandbox runtime contract and its backends.

``api`` is the interface every backend implements (local bubblewrap now,
Kubernetes later); ``tests/contract/`` holds the suite every backend must pass.
Backend code (bubblewrap, cgroups, Kubernetes clients) lives only in the backend
packages: import-linter keeps it there.
"""
