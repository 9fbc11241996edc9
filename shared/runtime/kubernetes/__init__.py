"""The Kubernetes runtime: a sandbox is a hardened pod with a workspace volume and its own
NetworkPolicy; exec goes over the pods/exec websocket. ``names`` and ``manifests`` are
pure (what objects look like); ``channel`` speaks the exec protocol; ``runtime`` does the
API calls."""
