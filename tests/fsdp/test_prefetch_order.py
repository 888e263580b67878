"""Backward prefetching follows the reverse order in which forwards *ended*, as FSDP2's does.

A root that holds only the head (embedding and blocks sharded as their own units: torchtitan's
and torchao's shape) ends its forward last, so it is first in backward: once its gradients are
reduced and its weights resharded, no unit may prefetch it again. Prefetching by the order
forwards *began* made the embedding's unit gather the root once more per step for nothing."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp
from dbuffer import compat
from tests.fsdp.models import loss_fn, make_batches, make_model
from tests.harness import run_ranks, spy_collectives


def _head_only_root(model: nn.Module, api) -> nn.Module:
    api.fully_shard(model.embed)
    for block in model.blocks:
        api.fully_shard(block)
    return api.fully_shard(model)  # the root keeps norm and head


def _gathers_per_step(model, batches) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    per = batches[0][0].shape[0] // world
    steps = [(x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]) for x, y in batches]
    out = {}

    ours = _head_only_root(copy.deepcopy(model), fsdp)
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    counts = []
    for x, y in steps:
        with spy_collectives("all_gather") as seen:
            loss_fn(ours, x, y).backward()
        opt.step()
        opt.zero_grad()
        counts.append(len(seen))
    out["ours"] = counts

    from torch.distributed import fsdp as torch_fsdp

    theirs = _head_only_root(copy.deepcopy(model), torch_fsdp)
    opt = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    name = compat.all_gather_name()  # what torch's FSDP2 calls on this torch
    real, counts = getattr(dist, name), []
    for x, y in steps:
        calls = []

        def counting(*args, **kwargs):
            calls.append(1)
            return real(*args, **kwargs)

        setattr(dist, name, counting)
        try:
            loss_fn(theirs, x, y).backward()
        finally:
            setattr(dist, name, real)
        opt.step()
        opt.zero_grad()
        counts.append(len(calls))
    out["fsdp2"] = counts
    return out


def test_a_head_only_root_is_gathered_once_per_step_as_in_fsdp2() -> None:
    model, batches = make_model(), make_batches(3)
    for r in run_ranks(_gathers_per_step, 2, model, batches, backend="gloo"):
        units = 2 + len(model.blocks)  # root, embedding, blocks
        # every unit gathers in forward, every unit but the root again in backward
        assert r["ours"][1:] == [2 * units - 1] * 2, r
        assert r["ours"] == r["fsdp2"], r
