"""Property: any FSDP configuration trains like one process on the global batch.

Hypothesis draws the module tree (blocks, tied embedding, registration order against forward
order), which submodules become units, the strategy, the world size, micro-batches,
``reshard_after_forward`` and bucket splitting; every draw must reach the weights of
single-process AdamW training within fp32 noise. Threaded ranks (worlds 2 and 4).
"""

from __future__ import annotations

import copy

import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import fsdp
from tests.fsdp.models import full_state, make_batches, make_model, max_diff, reference, train
from tests.harness import run_ranks
from tests.hypothesis_profiles import examples

STEPS = 2

configs = st.fixed_dictionaries(
    {
        "blocks": st.integers(1, 3),
        "tie": st.booleans(),
        "reverse": st.booleans(),
        "units": st.sampled_from(["root", "blocks", "blocks+norm", "every_linear"]),
        "strategy": st.sampled_from(["no_shard", "optim", "optim_grads", "optim_grads_params"]),
        "world": st.sampled_from([2, 4]),
        "micro": st.sampled_from([1, 2]),
        "reshard_after_forward": st.booleans(),
        "bucket_size": st.sampled_from([None, 256]),
    }
)


def _shard(model, cfg: dict):
    kw = dict(
        sharding_strategy=cfg["strategy"],
        reshard_after_forward=cfg["reshard_after_forward"],
        bucket_size=cfg["bucket_size"],
    )
    if cfg["units"] == "every_linear":
        for block in model.blocks:
            for linear in (block.gate, block.up, block.down):
                fsdp.fully_shard(linear, **kw)
    if cfg["units"] in ("blocks", "blocks+norm"):
        for block in model.blocks:
            fsdp.fully_shard(block, **kw)
    if cfg["units"] == "blocks+norm":
        fsdp.fully_shard(model.norm, **kw)
    return fsdp.fully_shard(model, **kw)


def _train(model, batches, cfg: dict) -> dict:
    m = _shard(copy.deepcopy(model), cfg)
    train(m, batches, rank=dist.get_rank(), world=dist.get_world_size(), micro=cfg["micro"])
    return full_state(m)


@settings(max_examples=examples(10))
@given(cfg=configs)
def test_any_configuration_trains_like_one_process(cfg) -> None:
    model = make_model(blocks=cfg["blocks"], tie=cfg["tie"], reverse=cfg["reverse"])
    batches = make_batches(STEPS)
    ref = reference(model, batches)
    states = run_ranks(_train, cfg["world"], model, batches, cfg, backend="threaded")
    for state in states:
        assert max_diff(state, ref) <= 1e-5, cfg
