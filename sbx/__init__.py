"""The ``sbx`` operator tool: run a whole stack locally and inspect any stack.

It never imports a service: it starts them as processes (``python -m
services.<name>``) and talks to them only through NATS and HTTP.
"""
