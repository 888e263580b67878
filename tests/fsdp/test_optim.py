"""fsdp.optim: flat optimizer steps over the DBuffer shards.

* fp32: equal to torch.optim on the same fsdp model (bit for bit) and to single-process training
  on the global batch, for every strategy, AdamW / Adam / SGD, micro-batches, unused parameters;
* BF16 main grads: as close to the fp32 reference as torch.optim on the same fsdp model with the
  same policy (which upcasts whole gradients), and no FP32 tensor the size of a gradient shard is
  made during backward or the step (every op's outputs are tracked);
* state_dict round trip, LR schedulers, errors.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import fsdp
from tests.fsdp.models import full_state, make_batches, make_model, max_diff, reference, train
from tests.harness import run_ranks

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
STEPS = 4
LR = 1e-2


def shard(model, **kw):
    for block in model.blocks:
        fsdp.fully_shard(block, **kw)
    return fsdp.fully_shard(model, **kw)


OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, dict(lr=LR, weight_decay=0.1)),
    "adam": (torch.optim.Adam, dict(lr=LR, weight_decay=0.1, amsgrad=True)),
    "sgd": (torch.optim.SGD, dict(lr=LR, momentum=0.9, weight_decay=0.1, nesterov=True)),
}


def _fp32_parity(model, batches, ref_by_opt, chunk_numel) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for strategy in STRATEGIES:
        for name, (cls, kw) in OPTIMIZERS.items():
            for micro in (1, 2):
                flat_model = shard(copy.deepcopy(model), sharding_strategy=strategy)
                torch_model = shard(copy.deepcopy(model), sharding_strategy=strategy)
                train(
                    flat_model, batches, rank=rank, world=world, micro=micro,
                    make_opt=lambda params: fsdp.FlatOptimizer(params, cls, chunk_numel=chunk_numel, **kw),
                )
                train(torch_model, batches, rank=rank, world=world, micro=micro, make_opt=lambda params: cls(params, **kw))
                flat, ref_torch = full_state(flat_model), full_state(torch_model)
                out[(strategy, name, micro)] = (max_diff(flat, ref_torch), max_diff(flat, ref_by_opt[name]))
    return out


@pytest.mark.parametrize("backend,world,chunk_numel", [("gloo", 2, 1 << 20), ("threaded", 4, 7)])
def test_fp32_equals_torch_optim_and_single_process(backend, world, chunk_numel) -> None:
    model, batches = make_model(), make_batches(STEPS)
    refs = {
        name: reference(model, batches, make_opt=lambda params, cls=cls, kw=kw: cls(params, **kw))
        for name, (cls, kw) in OPTIMIZERS.items()
    }
    table = run_ranks(_fp32_parity, world, model, batches, refs, chunk_numel, backend=backend)[0]
    for key, (vs_torch, vs_single) in table.items():
        print(f"{backend} world={world} chunk={chunk_numel} {key}: vs torch.optim {vs_torch:.3g}, vs 1 process {vs_single:.3g}")
    assert all(vs_torch == 0.0 for vs_torch, _ in table.values()), table
    assert all(vs_single <= 1e-5 for _, vs_single in table.values()), table
