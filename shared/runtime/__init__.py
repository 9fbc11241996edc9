"""The sandbox runtime contract and its backends.

``api`` is the interface every backend implements (``local``: bubblewrap and cgroups on
this machine; ``kubernetes``: a pod each); ``tests/contract/`` holds the suite every
backend passes.
Backend code (bubblewrap, cgroups, Kubernetes clients) lives only in the backend
packages: import-linter keeps it there.
"""
