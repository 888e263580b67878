"""DCP checkpoints of FSDP x TP models reshard across (dp, tp) shapes at world 4 (issue 15 item 4).

A Llama-style model (tests/fsdp/test_tensor_parallel.py) is trained for two steps and saved with
DCP by fsdp on dp 2 x tp 2, by torch FSDP2 on dp 2 x tp 2 (plain ``dcp.save``), or by fsdp's
HFSDP on a replicate 2 x shard 2 mesh (no TP; :mod:`fsdp.compose.outer_shard`). Each checkpoint is loaded
into models of another init on dp 2 x tp 2, dp 1 x tp 4, tp 4 without data parallelism (plain
torch TP), dp 4 (fsdp only) and HFSDP; after the load the full parameters and the full AdamW
state equal the saved ones bit for bit. The model's attention cannot run forward at tp 4 (2
heads), which a load does not need: only shapes matter.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

import fsdp.checkpoint as ckpt
from fsdp import fully_shard
from tests.fsdp.test_checkpoint import _diff
from tests.fsdp.test_tensor_parallel import TP_PLAN, _steps, make_batches, make_model
from tests.harness import run_ranks

WORLD = 4
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
LAYOUTS = ["dp2xtp2", "dp1xtp4", "tp4", "dp4", "hfsdp"]
# What each source is loaded into: every layout, less the moves other tests cover (fsdp dp2xtp2 ->
# dp2xtp2 / dp4: test_tensor_parallel.py; HFSDP -> HFSDP: test_outer_shard.py).
TARGETS = {
    "fsdp": ["dp1xtp4", "tp4", "hfsdp"],
    "fsdp2": LAYOUTS,
    "hfsdp": ["dp2xtp2", "dp1xtp4", "tp4", "dp4"],
}


def _build(ref, layout: str, impl: str = "fsdp"):
    """``ref`` copied and parallelised as ``layout``; its AdamW and data-parallel mesh (None: no dp)."""
    if impl == "fsdp":
        shard_fn = fully_shard
    else:
        from torch.distributed.fsdp import fully_shard as shard_fn
    model = copy.deepcopy(ref)
    dp_mesh = None
    if layout == "hfsdp":  # (replicate 2, shard 2), optimizer sharded over both (fsdp.compose.outer_shard)
        dp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        for layer in model.layers:
            shard_fn(layer, mesh=dp_mesh, outer_dp_sharding_strategy="optim")
        shard_fn(model, mesh=dp_mesh, outer_dp_sharding_strategy="optim")
    elif layout == "dp4":
        dp_mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
        for layer in model.layers:
            shard_fn(layer, mesh=dp_mesh)
        shard_fn(model, mesh=dp_mesh)
    else:
        dp, tp = {"dp2xtp2": (2, 2), "dp1xtp4": (1, 4), "tp4": (1, 4)}[layout]
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        for layer in model.layers:
            parallelize_module(layer, mesh["tp"], TP_PLAN)
            if layout != "tp4":
                shard_fn(layer, mesh=mesh["dp"])
        if layout != "tp4":
            dp_mesh = mesh["dp"]
            shard_fn(model, mesh=dp_mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), dp_mesh


def _save(ref, batches, path: str, impl: str):
    """Train dp 2 x tp 2 (``impl``: fsdp, or torch FSDP2 saved with plain dcp.save; "hfsdp":
    fsdp's HFSDP on a 2 x 2 data-parallel mesh without TP) and save; rank 0 returns the full
    parameters and AdamW state."""
    if impl == "hfsdp":
        model, opt, dp_mesh = _build(ref, "hfsdp")
    else:
        model, opt, dp_mesh = _build(ref, "dp2xtp2", impl)
    _steps(model, opt, batches, dp_mesh)
    if impl != "fsdp2":
        msd, osd = ckpt.get_state_dict(model, opt)
        ckpt.save({"model": msd, "optim": osd}, path)
        return ckpt.get_state_dict(model, opt, options=FULL)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    return get_state_dict(model, opt, options=FULL)


def _load_each(other, path: str, layouts: list[str], allow_unverified: bool = False) -> dict:
    """Load into ``other`` parallelised as each layout (fsdp, or plain torch TP for tp4); rank 0
    returns the full parameters and AdamW state after each load. ``allow_unverified``: the
    checkpoint was written by plain ``dcp.save`` (FSDP2's), which writes no checksums."""
    out = {}
    for layout in layouts:
        model, opt, _ = _build(other, layout)
        msd, osd = ckpt.get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        ckpt.load(state, path, allow_unverified=allow_unverified)
        ckpt.set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        out[layout] = ckpt.get_state_dict(model, opt, options=FULL)
    return out


@pytest.mark.parametrize("impl", ["fsdp", "fsdp2", "hfsdp"])
def test_fsdp_tp_checkpoint_reshards_to_every_dp_tp_shape(tmp_path, impl) -> None:
    model, other = make_model(), make_model(seed=7)
    path = os.path.join(str(tmp_path), "ckpt")
    saved = run_ranks(_save, WORLD, model, make_batches(2), path, impl, backend="threaded", timeout=120)[0]
    assert saved[0] and saved[1]["state"]  # rank 0 holds every parameter and its AdamW state
    loaded = run_ranks(
        _load_each, WORLD, other, path, TARGETS[impl], impl == "fsdp2", backend="threaded", timeout=180
    )[0]
    assert list(loaded) == TARGETS[impl]
    for layout, state in loaded.items():
        assert _diff(saved, state) == [], (layout, _diff(saved, state)[:5])
