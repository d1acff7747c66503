"""The loopback world (harness.py) for the connector's unit tests."""

from __future__ import annotations

import pytest

from harness import World


@pytest.fixture
def world():
    w = World()
    yield w
    w.close()
