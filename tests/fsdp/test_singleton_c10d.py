"""World 1 through the collective code of world N: ``dbuffer.collectives.singleton_groups_communicate``.

A group of one normally makes no c10d call (a copy), so one process on one GPU would never run an
NCCL all-gather or reduce-scatter, nor the stream ordering around them. With the switch on, every
collective of a fully_shard training step calls c10d as a group of N does; training still equals
the plain model (the collectives of one rank are copies, the values the same), and without it no
c10d call is made.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import fsdp
from dbuffer import compat
from dbuffer.collectives import singleton_groups_communicate
from tests.fsdp.models import full_state, make_batches, make_model, max_diff, reference, train
from tests.fsdp.test_parity import shard
from tests.harness import run_ranks

GATHER, REDUCE_SCATTER = compat.all_gather_name(), compat.reduce_scatter_name()  # this torch's names
C10D = (GATHER, REDUCE_SCATTER, "all_to_all_single", "all_reduce", "isend", "irecv", "broadcast")


def _counted_training(model, batches, on: bool) -> tuple[dict, dict]:
    counts = dict.fromkeys(C10D, 0)
    originals = {name: getattr(dist, name) for name in C10D}

    def counting(name):
        def call(*args, **kwargs):
            counts[name] += 1
            return originals[name](*args, **kwargs)

        return call

    for name in C10D:
        setattr(dist, name, counting(name))
    try:
        states = {}
        with singleton_groups_communicate(on):
            for strategy in ("optim_grads_params", "no_shard"):
                m = shard(copy.deepcopy(model), True, sharding_strategy=strategy,
                          mp_policy=fsdp.MixedPrecisionPolicy(param_dtype=torch.float32))
                train(m, batches)
                states[strategy] = full_state(m)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return states, counts


def test_world_1_calls_c10d_when_asked_and_still_trains_like_the_plain_model() -> None:
    model, batches = make_model(), make_batches(2)
    ref = reference(model, batches)
    for on in (True, False):
        (states, counts), = run_ranks(_counted_training, 1, model, batches, on, backend="gloo")
        for strategy, state in states.items():
            assert max_diff(state, ref) <= 1e-5, (on, strategy, max_diff(state, ref))
        gathers = counts[GATHER] + counts["irecv"]
        reductions = counts["all_to_all_single"] + counts[REDUCE_SCATTER] + counts["all_reduce"]
        if on:  # gloo's paths: the one-call all-gather and all-to-all + local sum; no_shard all-reduces
            assert gathers > 0 and counts["all_to_all_single"] > 0 and counts["all_reduce"] > 0, counts
        else:
            assert gathers == 0 and reductions == 0, counts


def _dbuffer_primitives_alone() -> list[bool]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard

    from dbuffer import DBuffer

    mesh = init_device_mesh("cpu", (1,))
    same = []
    for rows in (3, 300_000):  # under and over gloo's 2 MiB point-to-point switch
        shapes = [(rows, 2), (5,)]
        grads = DBuffer(mesh, [Partial("avg")], shapes, torch.float32)
        grads.local_buffer.copy_(torch.randn(grads.local_buffer.numel()))
        with singleton_groups_communicate():
            sharded = grads.redistribute([Shard(0)])
            full = sharded.redistribute([Replicate()])
            summed = grads.redistribute([Replicate()])
        same += [torch.equal(t.local_buffer, grads.local_buffer) for t in (sharded, full, summed)]
    return same


def test_dbuffer_primitives_of_a_group_of_one_that_communicates_are_exact() -> None:
    (same,) = run_ranks(_dbuffer_primitives_alone, 1, backend="gloo")
    assert all(same), same
