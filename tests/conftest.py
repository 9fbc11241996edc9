"""Shared fixtures: one real nats-server per test session, a namespace per test.

Also the one place the ``needs_root`` marker becomes a skip when the suite is not root.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from nats.aio.client import Client

from shared.contract import subjects
from tests import support


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if os.geteuid() == 0:
        return
    for item in items:
        if (marker := item.get_closest_marker("needs_root")) is not None:
            reason = marker.args[0] if marker.args else "needs root"
            item.add_marker(pytest.mark.skip(reason=reason))


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
