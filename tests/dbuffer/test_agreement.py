"""Ranks that build different DBuffers get the same clear error on every rank, before any
collective that could crash or return garbage (real gloo processes: a crash would kill one)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from dbuffer import DBuffer
from dbuffer.agreement import RankMismatchError
from tests.harness import run_ranks


def _build(shapes_by_rank, dtype_by_rank=None, local_by_rank=None) -> str:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rank = dist.get_rank()
    dtype = (dtype_by_rank or {}).get(rank, torch.float32)
    local = (local_by_rank or {}).get(rank)
    try:
        buf = DBuffer(mesh, [Shard(0)], shapes_by_rank[rank], dtype, local_buffer=local)
    except RankMismatchError as exc:
        return str(exc)
    out = DBuffer(mesh, [Replicate()], shapes_by_rank[rank], dtype)
    buf.allgather(0, out=out)
    return "built"


def test_different_shapes_raise_on_every_rank_naming_the_tensor_and_ranks() -> None:
    for big in (False, True):  # small shards and >= 2 MiB ones (gloo's point-to-point path)
        rows = 600_000 if big else 5
        messages = run_ranks(_build, 2, {0: [(4, 3), (rows, 2)], 1: [(4, 3), (rows, 3)]}, backend="gloo")
        for m in messages:
            assert "tensor 1" in m and "rank 0" in m and "rank 1" in m and "same arguments" in m, m
        assert messages[0] == messages[1]


def test_more_tensors_or_another_dtype_on_one_rank() -> None:
    messages = run_ranks(_build, 2, {0: [(4, 3)], 1: [(4, 3), (2,)]}, backend="gloo")
    assert all("'tensor 1' is shape (2,) on rank 1 but missing on rank 0" in m for m in messages), messages
    messages = run_ranks(_build, 2, {0: [(4, 3)], 1: [(4, 3)]}, {1: torch.float64}, backend="gloo")
    assert all("'dtype'" in m for m in messages), messages


def test_agreeing_ranks_build_as_before() -> None:
    assert run_ranks(_build, 2, {0: [(4, 3)], 1: [(4, 3)]}, backend="gloo") == ["built", "built"]
