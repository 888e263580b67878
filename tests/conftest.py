"""Shared pytest setup: the multi-rank harness as a fixture, and hypothesis profiles."""

from __future__ import annotations

import sys

import pytest

from tests import hypothesis_profiles
from tests.harness import run_ranks, shutdown_pools


def pytest_configure(config: pytest.Config) -> None:
    if hypothesis_profiles.SEED is not None and config.getoption("hypothesis_seed", None) is None:
        from hypothesis import core

        core.global_force_seed = hypothesis_profiles.SEED  # what pytest's --hypothesis-seed sets
    config.addinivalue_line(
        "markers",
        "dp_mesh_dims: the test needs torch's DataParallelMeshDims (torch 2.12+); on an older torch it "
        "checks instead that using dp_mesh_dims raises the error naming the torch needed",
    )


def _hypothesis_line(config: pytest.Config) -> str:
    """The profile, and the randomized profile's seed: the one number that reruns a CI failure."""
    seed = config.getoption("hypothesis_seed", None) or hypothesis_profiles.SEED
    if seed is None:
        return f"hypothesis: profile {hypothesis_profiles.PROFILE!r} (derandomized)"
    return (
        f"hypothesis: profile {hypothesis_profiles.PROFILE!r}, {hypothesis_profiles.SCALE}x the examples, "
        f"seed {seed} (rerun: HYPOTHESIS_PROFILE={hypothesis_profiles.PROFILE} HYPOTHESIS_SEED={seed})"
    )


def pytest_sessionstart(session: pytest.Session) -> None:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and hypothesis_profiles.SEED is not None:  # printed under -q too
        reporter.write_line(_hypothesis_line(session.config))


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if hypothesis_profiles.SEED is not None:  # again at the end, beside the failures
        terminalreporter.write_line(_hypothesis_line(config))


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function):
    """A ``dp_mesh_dims`` test on a torch without ``DataParallelMeshDims`` cannot run (the API
    it exercises does not exist there); what holds there instead is checked:
    :func:`tests.versions.check_dp_mesh_dims_refused`."""
    if pyfuncitem.get_closest_marker("dp_mesh_dims") is None:
        return None
    from tests.versions import check_dp_mesh_dims_refused, has_dp_mesh_dims

    if has_dp_mesh_dims():
        return None
    check_dp_mesh_dims_refused()
    return True


@pytest.fixture
def ranks():
    """``ranks(fn, world_size, *args, backend=..., timeout=...)``: see :func:`tests.harness.run_ranks`."""
    return run_ranks


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Stop the gloo workers; a worker that did not exit 0 (a signal, an exit code, a hang at
    exit, or death between tests) fails the run, named by rank and signal."""
    bad = [e for e in shutdown_pools() if not e.clean]
    if not bad:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    lines = [str(e) for e in bad]  # e.g. "rank 1 of 2 (gloo) died with SIGABRT"
    if reporter is not None:
        reporter.ensure_newline()
        reporter.write_sep("=", "gloo workers did not exit cleanly", red=True)
        for line in lines:
            reporter.write_line(line, red=True)
    else:
        print("gloo workers did not exit cleanly:", *lines, sep="\n", file=sys.stderr)
    if session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
