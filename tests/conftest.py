"""Shared pytest setup: the multi-rank harness as a fixture, and hypothesis profiles."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

from tests.harness import run_ranks, shutdown_pools

settings.register_profile(
    "default", deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture
def ranks():
    """``ranks(fn, world_size, *args, backend=..., timeout=...)``: see :func:`tests.harness.run_ranks`."""
    return run_ranks


def pytest_sessionfinish(session, exitstatus):
    shutdown_pools()
