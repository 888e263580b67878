"""fully_shard with the ragged (element-granular) layout: training parity and state dicts.

``layout_policy("ragged")`` forces every default group ragged, so the tiny test model's
parameters are cut mid-row at world 2 and 4. References: single-process training of the same
model on the global batch (fp32 within 1e-6), and the row-atomic run (bitwise where the math is
the same: AdamW is elementwise and every element's gradient is the same sum of the same ranks'
contributions whichever layout holds it).
"""

from __future__ import annotations

import copy
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions

import fsdp
from dbuffer import ElementShardedDTensor
from dbuffer.layout import Layout, RaggedLayout
from fsdp import checkpoint
from fsdp.group.layout_choice import group_layout, layout_policy
from tests.fsdp.models import full_state, make_batches, make_model, max_diff, reference, train
from tests.harness import run_ranks

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
STEPS = 3


def _shard(model, kind: str, **kw):
    with layout_policy(kind):
        for block in model.blocks:
            fsdp.fully_shard(block, **kw)
        return fsdp.fully_shard(model, **kw)


def _flat_params(model) -> int:
    return sum(isinstance(p, ElementShardedDTensor) for p in model.parameters())


def _parity(model, batches, ref, ref_clip) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for strategy in STRATEGIES:
        ragged = _shard(copy.deepcopy(model), "ragged", sharding_strategy=strategy)
        row = _shard(copy.deepcopy(model), "row", sharding_strategy=strategy)
        flat = _flat_params(ragged)
        assert (flat > 0) == (strategy != "no_shard"), (strategy, flat)  # really cut mid-row
        assert _flat_params(row) == 0
        train(ragged, batches, rank=rank, world=world)
        train(row, batches, rank=rank, world=world)
        a, b = full_state(ragged), full_state(row)
        out[strategy] = (max_diff(a, ref), max_diff(a, b))
        clipped = _shard(copy.deepcopy(model), "ragged", sharding_strategy=strategy)
        train(clipped, batches, rank=rank, world=world, clip=0.5)
        out[strategy + "+clip"] = (max_diff(full_state(clipped), ref_clip), None)  # no row-atomic twin
    if world % 2 == 0:  # reshard_after_forward=2: the kept slice is a coarser cut of the ragged buffer
        m = _shard(copy.deepcopy(model), "ragged", reshard_after_forward=2)
        assert _flat_params(m) > 0
        train(m, batches, rank=rank, world=world)
        out["reshard_after_forward=2"] = (max_diff(full_state(m), ref), None)
    if world == 4:  # HSDP: the ragged layout of 4 shards, cut into 2 per replica
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        m = _shard(copy.deepcopy(model), "ragged", mesh=mesh)
        assert _flat_params(m) > 0
        train(m, batches, rank=rank, world=world)
        out["HSDP 2x2"] = (max_diff(full_state(m), ref), None)
    flat_opt = _shard(copy.deepcopy(model), "ragged")  # fsdp.optim's flat AdamW over the ragged shards
    train(flat_opt, batches, rank=rank, world=world, make_opt=lambda params: fsdp.FlatAdamW(params, lr=1e-2, weight_decay=0.1))
    out["FlatAdamW"] = (max_diff(full_state(flat_opt), ref), None)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_ragged_training_matches_single_process_and_row_atomic(world) -> None:
    model, batches = make_model(), make_batches(STEPS)
    ref = reference(model, batches)
    ref_clip = reference(model, batches, clip=0.5)
    results = run_ranks(_parity, world, model, batches, ref, ref_clip, backend="threaded")
    for key, (to_ref, to_row) in results[0].items():
        print(f"world={world} {key}: vs single process {to_ref:.3g}, vs row-atomic {to_row}")
        assert to_ref <= 1e-6, key
        assert to_row is None or to_row == 0.0, key  # bitwise
    assert all(r == results[0] for r in results)


def _state_dicts(model, batches, path: str) -> bool:
    rank, world = dist.get_rank(), dist.get_world_size()
    m = _shard(copy.deepcopy(model), "ragged")
    assert _flat_params(m) > 0
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    train(m, batches[:2], rank=rank, world=world, make_opt=lambda params: opt)
    expected = full_state(m)
    # full state dicts: gathered on export, each rank's elements on import
    full_opts = StateDictOptions(full_state_dict=True)
    msd, osd = checkpoint.get_state_dict(m, [opt], options=full_opts)
    # DCP: several boxes per element piece
    sd_model, sd_optim = checkpoint.get_state_dict(m, [opt])
    checkpoint.save({"model": sd_model, "optim": sd_optim}, path)
    train(m, batches[2:], rank=rank, world=world, make_opt=lambda params: opt)
    stepped = full_state(m)  # one more step: needs the optimizer state too
    into = {"dcp into row-atomic": "row", "dcp into FSDP2's torch.chunk pieces": "chunk"}
    for how in ("full", "dcp", *into):
        fresh = _shard(copy.deepcopy(model), into.get(how, "ragged"))
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        train(fresh, batches[:1], rank=rank, world=world, make_opt=lambda params: fresh_opt)  # other values
        if how == "full":
            checkpoint.set_state_dict(fresh, [fresh_opt], model_state_dict=msd, optim_state_dict=osd, options=full_opts)
        else:
            sd_model, sd_optim = checkpoint.get_state_dict(fresh, [fresh_opt])
            state = {"model": sd_model, "optim": sd_optim}
            checkpoint.load(state, path)
            checkpoint.set_state_dict(fresh, [fresh_opt], model_state_dict=state["model"], optim_state_dict=state["optim"])
        assert max_diff(full_state(fresh), expected) == 0.0, how
        train(fresh, batches[2:], rank=rank, world=world, make_opt=lambda params: fresh_opt)
        assert max_diff(full_state(fresh), stepped) == 0.0, how
    return True


def test_ragged_state_dicts_full_and_dcp() -> None:
    model, batches = make_model(), make_batches(3)
    with tempfile.TemporaryDirectory() as tmp:
        assert all(run_ranks(_state_dicts, 2, model, batches, tmp + "/ckpt", backend="threaded"))


def test_auto_policy_keeps_small_models_row_atomic_and_cuts_large_padding() -> None:
    shapes = [(5, 7), (3,)]
    row = group_layout(shapes, 4)
    assert isinstance(row, Layout) and row.padding_fraction > 0.001  # pads, but only a few elements
    with layout_policy("auto", min_padding_per_shard=0):
        ragged = group_layout(shapes, 4)
    assert isinstance(ragged, RaggedLayout) and ragged.padding_numel < row.padding_numel
    with layout_policy("ragged"):
        assert isinstance(group_layout(shapes, 4), RaggedLayout)
    assert isinstance(group_layout(shapes, 4), Layout)  # restored on exit
    # Llama-3-70B-like decoder layer at 1024 ranks: row atomicity pads far above 0.1%.
    d, kv, f = 8192, 1024, 28672
    layer = [(d, d), (kv, d), (kv, d), (d, d), (f, d), (f, d), (d, f), (d,), (d,)]
    chosen = group_layout(layer, 1024)
    assert isinstance(chosen, RaggedLayout) and chosen.padding_fraction <= 0.001
    with pytest.raises(ValueError, match="kind must be one of"):
        with layout_policy("striped"):
            pass


def _disagreeing_policies() -> str:
    from dbuffer.agreement import RankMismatchError

    model = make_model()
    kind = "ragged" if dist.get_rank() == 0 else "row"
    try:
        with layout_policy(kind):
            fsdp.fully_shard(model)
    except RankMismatchError as exc:
        return str(exc)
    return ""


def test_ranks_with_different_layout_policies_raise_together() -> None:
    messages = run_ranks(_disagreeing_policies, 2, backend="threaded")
    assert all("layout policy" in m for m in messages), messages
