"""The local runtime: sandboxes as bubblewrap namespaces on this machine (the embedded default)."""
