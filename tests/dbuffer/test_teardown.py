"""dbuffer/teardown.py: a distributed process ends cleanly, every time.

The race itself runs in ``tests/dbuffer/exit_race.py`` (forked gloo ranks, full interpreter
finalisation); here it runs in its forced form, where a destroy-only exit aborts every time, so the
test can see the bug and shows that both ways out of :func:`shutdown` avoid it.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn_functional
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from dbuffer.teardown import shutdown

ROOT = Path(__file__).resolve().parents[2]
TRIALS = 2
UNGUARDED_TRIALS = 6  # the forcing misses in some trials under load (about half, at worst, in the suite)
PARALLEL = 4  # trials at once: as many as the two scripts of two trials each that ran before


def test_forced_exit_race_aborts_without_the_exit_guard_and_never_with_it_or_after_shutdown() -> None:
    """The race forced (exit_race.py --forced): a recipe that ends without
    ``shutdown`` (``destroy_process_group`` alone, or a framework's exit that keeps the mesh and
    a DTensor in a global, destroying the group or not) aborts when the exit guard ``import dbuffer``
    registers is taken away (in at least one of its trials: the forcing makes the race likely, not
    certain) and never with it; ``shutdown()`` and ``shutdown(0)`` never abort either. One script, whose
    trials of all the modes share ``PARALLEL`` slots (most of a guarded trial is a sleep that the
    forcing needs), the long guarded ones first."""
    modes = ["destroy", "exit", "kept-destroy", "shutdown", "unguarded-destroy", "unguarded-exit", "shutdown-exit"]
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "dbuffer" / "exit_race.py"), "--forced",
                          "--trials", str(TRIALS), "--unguarded-trials", str(UNGUARDED_TRIALS),
                          "--parallel", str(PARALLEL), *modes],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    results = {r["mode"]: r for r in map(json.loads, run.stdout.splitlines())}
    assert sorted(results) == sorted(modes), output
    # Without the guard the recipes abort: the test can see the bug ...
    for mode in ("unguarded-destroy", "unguarded-exit"):
        assert results[mode]["aborted"] >= 1 and results[mode]["failed"] == [], output
    # ... and with it nothing does; shutdown() left no group and no extra OS thread (else exit 3
    # or 4, listed in "failed"), shutdown(0) left through os._exit with the mesh still held.
    for mode in ("destroy", "exit", "kept-destroy", "shutdown", "shutdown-exit"):
        assert (results[mode]["aborted"], results[mode]["failed"]) == (0, []), output


def _group_after_dtensor_work() -> weakref.ReferenceType:
    """A fake world of 4 in this process, left as any DTensor program leaves it: torch's caches
    hold the mesh, and ``torch.distributed.nn.functional`` captured the group as if first
    imported now (``group=group.WORLD``). Returns a weak reference to the group."""
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    dist_nn_functional.broadcast.__defaults__ = (dist.group.WORLD,)
    mesh = init_device_mesh("cpu", (4,))
    x = DTensor.from_local(torch.ones(2, 3), mesh, [Shard(0)])
    assert (x + 1).redistribute(mesh, [Replicate()]).shape == (8, 3)
    return weakref.ref(dist.group.WORLD)


@pytest.mark.parametrize("destroy_first", [False, True])
def test_shutdown_frees_a_group_held_by_torch_caches_and_captured_defaults(destroy_first: bool) -> None:
    saved = dist_nn_functional.broadcast.__defaults__
    try:
        group = _group_after_dtensor_work()
        if destroy_first:  # what the tools did: the group outlives destroy_process_group
            dist.destroy_process_group()
            gc.collect()
            assert group() is not None
            shutdown()  # with no group left to watch, shutdown only clears what holds them
            gc.collect()
        else:
            assert shutdown() is True
        assert group() is None
        assert dist_nn_functional.broadcast.__defaults__ == (None,)
    finally:
        dist_nn_functional.broadcast.__defaults__ = saved
        if dist.is_initialized():
            dist.destroy_process_group()


def test_shutdown_reports_a_group_something_else_still_holds() -> None:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    group = weakref.ref(dist.group.WORLD)
    kept = init_device_mesh("cpu", (2,))  # a mesh in a live variable keeps its group
    assert shutdown() is False  # (shutdown(0) would leave through os._exit regardless)
    assert not dist.is_initialized() and group() is not None
    del kept
    gc.collect()
    assert group() is None
