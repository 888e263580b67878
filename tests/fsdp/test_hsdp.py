"""HSDP: a 2-D (replicate, shard) mesh. Parameters are sharded and gathered inside the shard
group only; gradients reduce-scatter inside it and all-reduce across replicas in one
``redistribute``. Parity against one process on the global batch, all four strategies; an HSDP
checkpoint loads into a 1-D ZeRO-3 model exactly."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

import fsdp
from tests.fsdp.models import full_state, make_batches, make_model, max_diff, reference, train
from tests.harness import run_ranks, spy_collectives

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]


def _hsdp(model, batches, ref) -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    rank = dist.get_rank()
    out = {}
    for strategy in STRATEGIES:
        m = copy.deepcopy(model)
        for block in m.blocks:
            fsdp.fully_shard(block, mesh=mesh, sharding_strategy=strategy)
        fsdp.fully_shard(m, mesh=mesh, sharding_strategy=strategy)
        group = m._fsdp_state.groups[0]
        sharded = strategy != "no_shard"
        # sharded over the inner axis only: 2 shards, the same on both replicas
        assert group.main.num_shards == (2 if sharded else 1)
        assert group.main.shard_index == (rank % 2 if sharded else 0)
        want = [Replicate(), Shard(0)] if sharded else [Replicate(), Replicate()]
        assert all(list(p.placements) == want for p in m.parameters())
        train(m, batches, rank=rank, world=4, micro=2)
        out[strategy] = max_diff(full_state(m), ref)
    return out


@pytest.mark.parametrize("backend", ["threaded", "gloo"])
def test_hsdp_2x2_parity_every_strategy(backend) -> None:
    model, batches = make_model(), make_batches(4)
    ref = reference(model, batches)
    results = run_ranks(_hsdp, 4, model, batches, ref, backend=backend, timeout=120)
    print(results[0])
    assert all(r == results[0] for r in results)
    assert all(diff <= 1e-5 for diff in results[0].values()), results[0]


def _gathers_stay_in_shard_group() -> list:
    """Ranks of the process groups the ZeRO-3 gather and the gradient reduction run on."""
    from tests.fsdp.models import loss_fn

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    m = fsdp.fully_shard(make_model(), mesh=mesh)
    x, y = make_batches(1)[0]
    with spy_collectives("all_gather", "reduce_scatter", "all_reduce") as seen:
        loss_fn(m, x[:4], y[:4]).backward()
    return sorted(set(seen))


def test_hsdp_gathers_in_shard_group_and_reduces_across_replicas() -> None:
    results = run_ranks(_gathers_stay_in_shard_group, 4, backend="gloo")  # processes: the spy is global
    rank0 = dict((kind, ranks) for kind, ranks in results[0])
    # rank 0's shard group is {0, 1}; its replica group is {0, 2}
    assert rank0 == {"all_gather": (0, 1), "reduce_scatter": (0, 1), "all_reduce": (0, 2)}, results[0]


def _hsdp_checkpoint_to_zero3(model, other, batches, path: str) -> tuple:
    """Train HSDP 2x2, save; load into a 1-D ZeRO-3 model of a different init on the same ranks."""
    from tests.fsdp.test_checkpoint import _diff, _full, _load, _save, _steps

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    m = copy.deepcopy(model)
    for block in m.blocks:
        fsdp.fully_shard(block, mesh=mesh)
    fsdp.fully_shard(m, mesh=mesh)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    _steps(m, opt, batches)
    _save(m, opt, path)
    saved = _full(m, opt)
    o = copy.deepcopy(other)
    for block in o.blocks:
        fsdp.fully_shard(block)
    fsdp.fully_shard(o)
    opt2 = torch.optim.AdamW(o.parameters(), lr=1e-2, weight_decay=0.1)
    _load(o, opt2, path)
    loaded = _full(o, opt2)
    return _diff(saved, loaded), len(saved[0])


def test_hsdp_checkpoint_loads_into_zero3_exactly(tmp_path) -> None:
    diff, saved = run_ranks(
        _hsdp_checkpoint_to_zero3, 4, make_model(), make_model(seed=3), make_batches(2), str(tmp_path / "c"), timeout=120
    )[0]
    assert saved == len(dict(make_model().named_parameters()))  # rank 0 gathered every parameter
    assert diff == []  # parameters and AdamW state, bit for bit
