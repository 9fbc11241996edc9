"""Shared fixtures: one real nats-server per test session, a namespace per test."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from nats.aio.client import Client

from shared.contract import subjects
from tests import support


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[support.NatsServer]:
    server = support.NatsServer(store=tmp_path_factory.mktemp("nats"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def namespace() -> str:
    return support.new_namespace()


@pytest.fixture
async def bus(
    nats_server: support.NatsServer, namespace: str
) -> AsyncIterator[tuple[Client, subjects.Topology]]:
    nc, topology = await support.connect(nats_server.url, namespace)
    yield nc, topology
    await nc.close()


@pytest.fixture
def log_dir(tmp_path: Path) -> Path:
    path = tmp_path / "logs"
    path.mkdir()
    return path
