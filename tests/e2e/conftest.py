"""Fixtures of the e2e tier: a real `sbx up` per test (see stacks.py)."""

from __future__ import annotations

import pytest

from tests.e2e.stacks import running_stack


@pytest.fixture
def stack(tmp_path):
    state = tmp_path / "state"
    with running_stack(state) as (proc, url):
        yield proc, state, url
