"""Wiring of the proxy-scaler service."""

from shared import service

setup = service.lifecycle_only
