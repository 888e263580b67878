"""Explicit buckets and the bucket-size policy: grouping by name independent of module
boundaries, each bucket with its own strategy and precision; parity against one process; every
parameter in exactly one bucket; payload in registration order; misuse raised before any
collective."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

import fsdp
from tests.fsdp.models import Block, full_state, make_batches, make_model, max_diff, reference, train
from tests.fsdp.test_api import _expect
from tests.harness import run_ranks


def _names(group) -> list[str]:
    return [info.fqn for info in group.infos]


def _bucketed(model, batches, ref) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    plain = fsdp.fully_shard(copy.deepcopy(model))
    train(plain, batches, rank=rank, world=world)
    m = copy.deepcopy(model)
    buckets = [
        # cuts across the blocks: every block's gate and up projections communicate together
        fsdp.Bucket(["blocks.*.gate.weight", "blocks.*.up.*"]),
        fsdp.Bucket("head.weight", sharding_strategy="optim"),  # kept whole after the gather
        fsdp.Bucket("*norm.weight", sharding_strategy="no_shard"),
    ]
    fsdp.fully_shard(m, buckets=buckets, bucket_size=4 * 8 * 12)  # rest: at most one 8x12 fp32 weight each
    groups = m._fsdp_state.groups
    names = [_names(g) for g in groups]
    strategies = [g.strategy.name for g in groups]
    train(m, batches, rank=rank, world=world)
    return {
        "names": names,
        "strategies": strategies,
        "vs_reference": max_diff(full_state(m), ref),
        "vs_unbucketed": max_diff(full_state(m), full_state(plain)),
    }


@pytest.mark.parametrize("backend,world", [("gloo", 2), ("threaded", 4)])
def test_buckets_cut_across_modules_and_keep_parity(backend, world) -> None:
    model, batches = make_model(), make_batches(4)
    ref = reference(model, batches)
    out = run_ranks(_bucketed, world, model, batches, ref, backend=backend)[0]
    every = [n for n, _ in model.named_parameters()]
    flat = [n for group in out["names"] for n in group]
    assert sorted(flat) == sorted(every) and len(flat) == len(every)  # each parameter exactly once
    for group in out["names"]:  # payload order = registration order
        assert group == [n for n in every if n in group]
    assert out["names"][0] == [
        "blocks.0.gate.weight", "blocks.0.up.weight", "blocks.0.up.bias",
        "blocks.1.gate.weight", "blocks.1.up.weight", "blocks.1.up.bias",
    ]
    assert out["names"][1] == ["head.weight"]
    assert out["names"][2] == ["blocks.0.norm.weight", "blocks.1.norm.weight", "norm.weight"]
    assert out["strategies"][:3] == ["optim_grads_params", "optim", "no_shard"]
    # the rest (embed, the down projections) split at the bucket size, in registration order
    assert out["names"][3:] == [["embed.weight"], ["blocks.0.down.weight"], ["blocks.1.down.weight"]]
    print(out["vs_reference"], out["vs_unbucketed"])
    assert out["vs_reference"] <= 1e-5
    # Grouping changes neither the values nor the order of any element's reduction.
    assert out["vs_unbucketed"] == 0.0


def _bucket_policy_and_placement() -> dict:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    bf16 = fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    torch.manual_seed(0)  # every rank builds the same values (fully_shard checks)
    block = fsdp.fully_shard(Block(), mesh=mesh, buckets=[fsdp.Bucket("up.*", mp_policy=bf16)])
    up, rest = block._fsdp_state.groups
    return {
        "up_model": up.weights.unsharded.dtype,
        "rest_model": rest.weights.unsharded.dtype,
        "placements": {n: list(p.placements) for n, p in block.named_parameters()},
    }


def test_bucket_has_its_own_precision_policy() -> None:
    out = run_ranks(_bucket_policy_and_placement, 2)[0]
    assert out["up_model"] == torch.bfloat16 and out["rest_model"] == torch.float32
    assert all(p == [Shard(0)] for p in out["placements"].values())


class Experts(nn.Module):
    def __init__(self, experts: int) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(experts, 4, 6))
        self.router = nn.Linear(4, experts)


def _misuse() -> dict:
    from dbuffer import Owned

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    mesh2d = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("replicate", "shard"))  # every rank: it makes groups
    out: dict = {}
    if dist.get_rank() == 0:  # only rank 0 calls: any collective would hang the test
        _misuse_alone(out, mesh, mesh2d)
    torch.manual_seed(0)  # every rank (fully_shard's agreement check is a collective), same values
    fsdp.fully_shard(Experts(4), mesh=mesh, buckets=[fsdp.Bucket("w_in", per_tensor=True)])  # 4 over 2: fine
    return out


def _misuse_alone(out: dict, mesh, mesh2d) -> None:
    from dbuffer import Owned

    B = fsdp.Bucket
    out["overlap"] = _expect(
        lambda: fsdp.fully_shard(Block(), mesh=mesh, buckets=[B("up.*"), B("*.bias")]), ValueError, "exactly one bucket"
    )
    out["unmatched"] = _expect(lambda: fsdp.fully_shard(Block(), mesh=mesh, buckets=[B("nope.*")]), ValueError, "matches no parameter")
    out["experts"] = _expect(
        lambda: fsdp.fully_shard(Experts(3), mesh=mesh, buckets=[B("w_in", per_tensor=True)]), ValueError, "divisible by 2"
    )
    out["placement"] = _expect(
        lambda: fsdp.fully_shard(Block(), mesh=mesh, buckets=[B("up.*", placement=Replicate())]), ValueError, "Owned()"
    )
    out["size"] = _expect(lambda: fsdp.fully_shard(Block(), mesh=mesh, bucket_size=0), ValueError, "bucket_size")
    out["factor"] = _expect(
        lambda: fsdp.fully_shard(Block(), mesh=mesh, buckets=[B("up.*", gradient_divide_factor=-1)]), ValueError, "positive"
    )
    out["owned_2d"] = _expect(
        lambda: fsdp.fully_shard(Block(), mesh=mesh2d, buckets=[B("up.*", placement=Owned())]), ValueError, "1-D mesh"
    )
    out["type"] = _expect(lambda: fsdp.fully_shard(Block(), mesh=mesh, buckets=["up.*"]), TypeError, "fsdp.Bucket")
    block = Block()
    out["untouched"] = _expect(lambda: fsdp.fully_shard(block, mesh=mesh, buckets=[B("up.*"), B("up.weight")]), ValueError, "up.weight")
    assert type(block) is Block and not any(hasattr(p, "_local_tensor") for p in block.parameters())


def test_bucket_misuse_raises_before_any_collective() -> None:
    out = run_ranks(_misuse, 2, timeout=60)[0]
    names = ("overlap", "unmatched", "experts", "placement", "size", "factor", "owned_2d", "type", "untouched")
    assert out == {k: "ok" for k in names}
