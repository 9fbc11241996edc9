"""Wiring of the reaper service."""

from shared import service

setup = service.lifecycle_only
