"""fsdp.torch_names: code written only against torch's FSDP2 names (as accelerate, Lightning
Fabric and torchtitan write theirs) runs on fsdp while the switch is on, ``isinstance`` checks
against torch's ``FSDPModule`` included, and trains like one process; off, every name is torch's
object again, exactly."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
import torch.distributed as dist

import fsdp
from fsdp.unit import torch_names as switch
from tests.fsdp.models import full_state, make_batches, make_model, max_diff, reference, train
from tests.harness import run_ranks


def _torch_objects() -> dict:
    out = {}
    for path in switch._PUBLIC + switch._CLASS_ONLY:
        module = importlib.import_module(path)
        out.update({(path, n): getattr(module, n) for n in switch._ours() if hasattr(module, n)})
    return out


def _framework_step(model, batches) -> dict:
    """A training loop that knows only torch's names, looked up at call time as frameworks do."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    for block in model.blocks:
        fully_shard(block, mp_policy=MixedPrecisionPolicy())
    fully_shard(model, mp_policy=MixedPrecisionPolicy())
    wrapped = [m for m in model.modules() if isinstance(m, FSDPModule)]
    model.set_requires_gradient_sync(True)  # an FSDPModule method frameworks call
    train(model, batches, rank=dist.get_rank(), world=dist.get_world_size())
    return {"units": len(wrapped), "ours": fsdp.fully_shard.state(model) is not None}


def _run_under_switch(model, batches, ref) -> dict:
    before = _torch_objects()
    model = copy.deepcopy(model)
    with fsdp.torch_names():
        out = _framework_step(model, batches)
    after = _torch_objects()
    out["restored"] = after.keys() == before.keys() and all(after[k] is v for k, v in before.items())
    out["diff"] = max_diff(full_state(model), ref)
    return out


def test_a_loop_written_against_torch_names_runs_on_fsdp_and_trains_like_one_process() -> None:
    model, batches = make_model(), make_batches(3)
    ref = reference(model, batches)
    for r in run_ranks(_run_under_switch, 2, model, batches, ref, backend="gloo"):
        assert r["units"] == 3 and r["ours"], r  # isinstance(m, torch's FSDPModule) saw fsdp's units
        assert r["restored"], r
        assert r["diff"] <= 1e-5, r


def test_the_switch_is_idempotent_nests_and_restores_torch_exactly() -> None:
    import torch.distributed.fsdp as tfsdp

    before = _torch_objects()
    assert before[("torch.distributed.fsdp", "fully_shard")] is not fsdp.fully_shard
    try:
        fsdp.torch_names(True)
        fsdp.torch_names(True)
        assert tfsdp.fully_shard is fsdp.fully_shard and tfsdp.FSDPModule is fsdp.FSDPModule
        assert tfsdp.MixedPrecisionPolicy is fsdp.MixedPrecisionPolicy
        assert tfsdp.CPUOffloadPolicy is fsdp.CPUOffloadPolicy  # the same class either way
        with fsdp.torch_names(False):
            assert tfsdp.fully_shard is before[("torch.distributed.fsdp", "fully_shard")]
        assert tfsdp.fully_shard is fsdp.fully_shard  # the context restored what it found: on
    finally:
        fsdp.torch_names(False)
    after = _torch_objects()
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    with pytest.raises(TypeError, match="True or False"):
        fsdp.torch_names("yes")  # type: ignore[arg-type]
    assert torch.distributed.fsdp.fully_shard is before[("torch.distributed.fsdp", "fully_shard")]
