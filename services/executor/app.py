"""Wiring of the executor service."""

from shared import service

setup = service.lifecycle_only
