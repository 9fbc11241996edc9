"""Wiring of the pool-manager service."""

from shared import service

setup = service.lifecycle_only
