"""The multi-rank harness itself: results per rank, error propagation, timeouts, three backends."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from tests.harness import RankError, RankTimeout, run_ranks

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


def _gather_shapes() -> tuple[tuple[int, ...], int]:
    out = torch.empty(dist.get_world_size() * 3)
    dist.all_gather_single(out, torch.full((3,), float(dist.get_rank())))
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


def test_fake_backend_gives_shapes_of_a_huge_world() -> None:
    [(shape, rank)] = run_ranks(_gather_shapes, 1024, backend="fake", fake_rank=517)
    assert shape == (3 * 1024,) and rank == 517


def test_bad_backend_is_rejected() -> None:
    with pytest.raises(ValueError, match="backend must be"):
        run_ranks(_rank_and_sum, 2, backend="mpi")
