"""A weight one unit owns and another unit's forward is handed, megatron-core's tie of the output
layer to the embedding (``HandedTinyLM``: the head owns no weight, the root's forward passes it
the embedding's). fsdp finds the read at the first forward (:mod:`fsdp.unit.read_watch`) and the
embedding unit keeps its weights for the head from then on: training equals one process, under
every strategy, where FSDP2's head would compute with the sharded DTensor. A tie made by
registering one parameter on two units' modules is still refused at the first forward, as in
FSDP2, and the error names both units and the ways out."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import fsdp
from tests.fsdp.models import HandedTinyLM, full_state, loss_fn, make_batches, make_model, max_diff, reference, train
from tests.fsdp.test_parity import STRATEGIES
from tests.harness import run_ranks


def _shard(model, **kw):
    """The embedding, each block, then the root: a unit each (Megatron-LM's FSDP2 wrapping);
    the embedding resharding after forward, as megatron-core asks."""
    fsdp.fully_shard(model.embed, reshard_after_forward=True, **kw)
    for block in model.blocks:
        fsdp.fully_shard(block, **kw)
    return fsdp.fully_shard(model, **kw)


def _slice(x, rank, world):
    per = x.shape[0] // world
    return x[rank * per : (rank + 1) * per]


def _handed(model, batches, ref) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for strategy in STRATEGIES:
        m = _shard(copy.deepcopy(model), sharding_strategy=strategy)
        train(m, batches, rank=rank, world=world, micro=2)
        out[strategy] = max_diff(full_state(m), ref)
    m = _shard(copy.deepcopy(model))
    embed = m.embed._fsdp_state
    x, y = (_slice(t, rank, world) for t in batches[0])
    loss_fn(m, x, y).backward()  # the first step finds the read
    out["read"] = list(embed.read_after_forward)
    out["dicts plain after the first forward"] = type(m.embed._parameters) is dict
    loss = loss_fn(m, x, y)  # later steps: kept from the embedding's forward to its backward
    out["gathered between forward and backward"] = (
        not isinstance(m.embed.weight, DTensor) and not embed.groups[0].weights.unsharded.is_storage_released()
    )
    loss.backward()
    out["freed after backward"] = isinstance(m.embed.weight, DTensor) and embed.groups[0].weights.unsharded.is_storage_released()
    return out


def test_a_weight_handed_to_another_units_forward_trains_equal_to_one_process() -> None:
    torch.manual_seed(0)
    model, batches = HandedTinyLM(), make_batches(3)
    ref = reference(model, batches, micro=2)
    result = run_ranks(_handed, 2, model, batches, ref, backend="gloo")[0]
    assert result.pop("read") == ["'embed.weight' is read in the forward of '<root>' (FSDPHandedTinyLM)"]
    for check in ("dicts plain after the first forward", "gathered between forward and backward", "freed after backward"):
        assert result.pop(check) is True, check
    bad = {strategy: d for strategy, d in result.items() if not d <= 1e-5}
    assert not bad, bad


def _registered_on_two_units(model, batches) -> str:
    m = copy.deepcopy(model)
    fsdp.fully_shard(m.embed)
    fsdp.fully_shard(m)  # the root's head registers the embedding's parameter too
    try:
        m(batches[0][0])
    except ValueError as e:
        return str(e)
    return "nothing raised"


def test_a_parameter_registered_on_two_units_is_refused_naming_both_and_the_ways_out() -> None:
    model, batches = make_model(tie=True), make_batches(1)
    messages = run_ranks(_registered_on_two_units, 2, model, batches, backend="gloo")
    assert messages[0] == messages[1]  # every rank, before any collective
    for part in ("'head.weight' is shared with a parameter already managed by another FSDP unit",
                 "(the unit of Embedding)", "the unit of TinyLM registers it too (on its Linear)",
                 "hand it to the other in forward", "fully_shard([module_a, module_b])"):
        assert part in messages[0], (part, messages[0])
