"""What a repeated collective skips (validation, planning, c10d's getters) must never go stale.

fsdp moves the same buffers the same way every step, so :class:`DBuffer` keeps each validated
plan per placements tuple and each mesh axis's group, and :mod:`dbuffer.collectives` each group's
size and backend. These tests change what a kept entry depends on and check the result follows.
"""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from dbuffer import DBuffer, collectives
from tests.harness import run_ranks

SHAPES = [(5, 3), (4,), (2, 2)]
S, R = Shard(0), Replicate()


def _values(buf: DBuffer, shift: float) -> None:
    """Fill this rank's shard with values that name the rank and the element."""
    rank = dist.get_rank()
    n = buf.local_buffer.numel()
    buf.local_buffer.copy_(torch.arange(n, dtype=buf.dtype) + 100 * rank + shift)


def _expected_gather(world: int, n: int, shift: float) -> torch.Tensor:
    return torch.cat([torch.arange(n, dtype=torch.float32) + 100 * r + shift for r in range(world)])


def _plans_follow_their_arguments() -> bool:
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    src = DBuffer(mesh, [S], SHAPES, torch.float32)
    out = DBuffer(mesh, [R], SHAPES, torch.float32, layout=src.layout)
    n = src.local_buffer.numel()
    gather_to = (R,)
    for shift in (0.0, 1.0):  # the second call is served from the kept plan: the same data moves
        _values(src, shift)
        src.redistribute(gather_to, out=out, async_op=True).wait()
        assert torch.equal(out.local_buffer, _expected_gather(world, n, shift))
    # a list is validated at every call: changing it in place changes the plan
    target = [R]
    src.redistribute(target, out=out)
    target[0] = S
    same = src.redistribute(target)
    assert same is src, "Shard(0) -> Shard(0) is no move"
    # a kept plan does not excuse a bad out: wrong placements, or a released storage, still raise
    wrong = DBuffer(mesh, [S], SHAPES, torch.float32, layout=src.layout)
    out.release_storage()
    for bad, words in ((wrong, "placements"), (out, "released storage")):
        try:
            src.redistribute(gather_to, out=bad)
        except ValueError as e:
            assert words in str(e), e
        else:
            raise AssertionError(f"redistribute into an out with bad {words} did not raise")
    # more distinct tuples than a buffer keeps: each still gets its own, correct plan
    for k in range(3 * DBuffer._PLANS_KEPT):
        fresh = tuple([R])
        res = src.redistribute(fresh)
        assert res.placements == (R,) and torch.equal(res.local_buffer, _expected_gather(world, n, 1.0)), k
    assert len(src._plans) <= DBuffer._PLANS_KEPT
    return True


def test_kept_plans_follow_their_arguments() -> None:
    assert all(run_ranks(_plans_follow_their_arguments, 2, backend="threaded", timeout=60))


def _group_facts_are_weak() -> int:
    group = dist.new_group(list(range(dist.get_world_size())))
    t = torch.ones(4)
    collectives.all_reduce(t, "sum", group)
    assert torch.equal(t, torch.full((4,), float(dist.get_world_size())))
    assert group in collectives._FACTS and collectives._FACTS[group].size == dist.get_world_size()
    default = torch.ones(2)
    collectives.all_reduce(default, "sum", None)  # group None: the default group (kept, weakly, as itself)
    assert torch.equal(default, torch.full((2,), float(dist.get_world_size())))
    held = len(collectives._FACTS)
    dist.destroy_process_group(group)
    del group
    gc.collect()
    return held - len(collectives._FACTS)


def test_group_facts_forget_a_destroyed_group() -> None:
    """The kept size and backend of a group do not keep the group alive."""
    assert run_ranks(_group_facts_are_weak, 2, backend="gloo", timeout=60) == [1, 1]
