"""The contract every service speaks: events, commands, subjects, settings, the bus.

Nothing in here imports a service. Services import modules from here
(``from shared import events``), never names from each other.
"""
