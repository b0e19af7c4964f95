"""Fixtures shared by the streaming client tests."""

from __future__ import annotations

import pytest

from simulator.serve import start_in_thread


@pytest.fixture(scope="module")
def fast():
    """The simulator's fast profile in a background thread, one per test module."""
    handle = start_in_thread("fast")
    yield handle
    handle.stop()
