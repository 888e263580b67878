"""The multi-rank harness itself: results per rank, error propagation, timeouts, three backends,
and how gloo workers end (a death during or between calls is named; a clean close exits 0)."""

from __future__ import annotations

import os
import resource
import threading
import time

import pytest
import torch
import torch.distributed as dist

from dbuffer import compat
from tests import harness
from tests.models import threads
from tests.harness import RankDied, RankError, RankTimeout, WorkerExit, run_ranks, shutdown_pools

_release_hung_thread = threading.Event()


def _rank_and_sum() -> tuple[int, float]:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), t.item()


def _fail_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise ValueError("deliberate failure")
    dist.all_reduce(torch.ones(1))  # rank 0 waits here for a peer that never comes


def _hang_on_rank_one() -> None:
    if dist.get_rank() == 1:  # a thread can't be killed: it waits for the test to release it
        _release_hung_thread.wait(600) if threading.current_thread().name.startswith("rank") else time.sleep(600)
    else:
        dist.all_reduce(torch.ones(1))  # waits for rank 1 until the harness gives up


def _die_in_the_call() -> None:
    """Both processes end in the middle of the call: rank 0 with an exit code, rank 1 aborts."""
    if dist.get_rank() == 0:
        os._exit(3)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file in the working tree
    os.abort()  # SIGABRT, as "terminate called without an active exception" raises


def _abort_rank_one_after_returning() -> int:
    """Rank 1 replies, then its process dies between calls (a worker thread aborts it)."""
    if dist.get_rank() == 1:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        threading.Timer(0.2, os.abort).start()
    return dist.get_rank()


def _gather_shapes() -> tuple[tuple[int, ...], int]:
    out = torch.empty(dist.get_world_size() * 3)
    getattr(dist, compat.all_gather_name())(out, torch.full((3,), float(dist.get_rank())))
    return tuple(out.shape), dist.get_rank()


@pytest.mark.parametrize("backend,world", [("gloo", 2), ("threaded", 4), ("threaded", 8)])
def test_results_come_back_per_rank(backend: str, world: int) -> None:
    results = run_ranks(_rank_and_sum, world, backend=backend)
    expected_sum = world * (world + 1) / 2
    assert results == [(r, expected_sum) for r in range(world)]


@pytest.mark.parametrize("backend", ["gloo", "threaded"])
def test_error_on_rank_one_names_rank_one(backend: str) -> None:
    with pytest.raises(RankError, match=r"rank 1 of 2 .*raised(.|\n)*deliberate failure"):
        run_ranks(_fail_on_rank_one, 2, backend=backend, timeout=60)
    # The harness recovers: the next call on the same world size works.
    assert run_ranks(_rank_and_sum, 2, backend=backend) == [(0, 3.0), (1, 3.0)]


@pytest.mark.parametrize("backend", ["gloo", "threaded"])
def test_hung_rank_is_cut_off_by_timeout(backend: str) -> None:
    _release_hung_thread.clear()
    start = time.monotonic()
    with pytest.raises(RankTimeout, match=r"ranks \[(0, )?1\] of 2"):
        run_ranks(_hang_on_rank_one, 2, backend=backend, timeout=3)
    assert time.monotonic() - start < 30
    assert run_ranks(_rank_and_sum, 2, backend=backend, timeout=30) == [(0, 3.0), (1, 3.0)]
    _release_hung_thread.set()


def test_clean_pool_close_reports_exit_code_zero_for_every_worker() -> None:
    assert run_ranks(_rank_and_sum, 2) == [(0, 3.0), (1, 3.0)]
    assert shutdown_pools(2) == [WorkerExit(2, 0, 0), WorkerExit(2, 1, 0)]
    assert shutdown_pools(2) == []  # nothing left to close; the next call starts a new pool


def test_worker_dying_between_calls_is_reported_at_pool_close() -> None:
    assert run_ranks(_abort_rank_one_after_returning, 2) == [0, 1]
    rank_one = harness._POOLS[2].procs[1]
    rank_one.join(timeout=30)  # dead before the pool is closed, not during its barrier
    exits = shutdown_pools(2)
    assert [str(e) for e in exits if not e.clean] == ["rank 1 of 2 (gloo) died with SIGABRT"]


def test_workers_dying_mid_call_fail_it_naming_rank_and_signal() -> None:
    expected = (r"^rank 0 of 2 \(gloo\) exited with code 3, rank 1 of 2 \(gloo\) died with SIGABRT "
                r"during _die_in_the_call\(\)")
    with pytest.raises(RankDied, match=expected):
        run_ranks(_die_in_the_call, 2, timeout=60)
    assert shutdown_pools(2) == []  # the failed call tore its pool down; nothing left to report


def test_fake_backend_gives_shapes_of_a_huge_world() -> None:
    [(shape, rank)] = run_ranks(_gather_shapes, 1024, backend="fake", fake_rank=517)
    assert shape == (3 * 1024,) and rank == 517


def test_bad_backend_is_rejected() -> None:
    with pytest.raises(ValueError, match="backend must be"):
        run_ranks(_rank_and_sum, 2, backend="mpi")


# ----------------------------------------------------------------------------- torch versions


def test_threaded_world_compat_gives_each_thread_its_own_comms_where_torch_has_none() -> None:
    """torch 2.11's threaded world lacks ``comms`` (its destroy_process_group reads it): the
    harness adds one list per thread; a world that has it (2.13+) is left alone."""
    import types

    class OldWorld:  # torch 2.11's shape: a thread-local store, no comms
        _world = threading.local()

    class NewWorld:
        comms = property(lambda self: ["torch's own"])

    old, new = types.SimpleNamespace(ThreadLocalWorld=OldWorld), types.SimpleNamespace(ThreadLocalWorld=NewWorld)
    threads.threaded_world_compat(old)
    threads.threaded_world_compat(new)
    assert NewWorld().comms == ["torch's own"]
    world = OldWorld()
    world.comms.append("main")
    seen = []
    thread = threading.Thread(target=lambda: seen.append(list(world.comms)))
    thread.start()
    thread.join()
    assert seen == [[]] and world.comms == ["main"] and world.comms is world.comms


def test_restore_autograd_threads_exits_what_an_old_uninstall_left() -> None:
    import types

    entered = torch.autograd.set_multithreading_enabled(False)  # what _install_threaded_pg does
    old = types.SimpleNamespace(_ctx_manager=entered)  # torch 2.11's uninstall leaves it set
    threads.restore_autograd_threads(old)
    assert old._ctx_manager is None
    assert torch._C._is_multithreading_enabled()
    new = types.SimpleNamespace(_ctx_manager=None)  # torch 2.13's uninstall already restored it
    threads.restore_autograd_threads(new)
    assert new._ctx_manager is None and torch._C._is_multithreading_enabled()
