"""Typed settings, read from the environment once at start-up and passed in.

Logic never reads ``os.environ``; each service's entry point calls
``*.from_env(os.environ)`` and hands the frozen result down. Invalid values stop
start-up with a :class:`~sbx_api.errors.ConfigError` naming the variable.

One module per concern, each the one place of its defaults and variable names:
:mod:`.values` (how one value is read), :mod:`.bus` (NATS, retention), :mod:`.service`
(every process), :mod:`.traces`, :mod:`.audit` (the executor's audit rate),
:mod:`.runtime` (the sandbox backend and its limits), :mod:`.kubernetes`,
:mod:`.lifecycle` (pools, limits, lifetimes), :mod:`.gateway` and :mod:`.proxies`.
"""
