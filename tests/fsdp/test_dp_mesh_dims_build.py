"""fully_shard with torch's ``dp_mesh_dims`` (2.12+): what is refused (before any collective, with
the fix), tensor parallelism on a sub-mesh next to it, DCP and full state dicts of the full-mesh
parameters, and a meta-device build (tests/fsdp/test_dp_mesh_dims.py trains them)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import fsdp
from tests.fsdp.models import VOCAB, make_batches, make_model
from tests.fsdp.test_dp_mesh_dims import LR, _dp_rank, _full, _local_loss, _max_diff, _shard, distribute_full
from tests.harness import run_ranks

# torch 2.12+ (DataParallelMeshDims); on 2.11 each test checks the clear refusal instead (tests/versions.py)
pytestmark = pytest.mark.dp_mesh_dims


# ----------------------------------------------------------------------------- misuse


def _misuse(case: str) -> str:
    torch.manual_seed(0)
    shape, names, shard = (2, 2), ("dp_shard", "tp"), "dp_shard"
    if case == "shard on the replicate dim":
        names = ("dp_replicate", "dp_shard")
    elif case == "shard dims apart":  # flattened into one shard dim, but tp lies between them
        shape, names, shard = (2, 1, 2), ("dp_shard", "tp", "cp"), ("dp_shard", "cp")
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    replicate = "dp_replicate" if "dp_replicate" in names else None
    dims = fsdp.DataParallelMeshDims(shard=shard, replicate=replicate)
    block = distribute_full(make_model().blocks[0], mesh)
    kw = {"mesh": mesh, "dp_mesh_dims": dims}
    w = block.up.weight
    if case in ("shard on a dp dim", "shard on the replicate dim"):
        placements = list(w.placements)
        placements[0] = Shard(1)  # dp_shard, or dp_replicate for HSDP
        block.up.weight = nn.Parameter(w.detach().redistribute(mesh, placements))
    elif case == "dp dim on another mesh":
        block.up.weight = nn.Parameter(distribute_tensor(w.detach().full_tensor(), mesh["dp_shard"], [Replicate()], src_data_rank=None))
    elif case == "partial on tp":
        block.up.weight = nn.Parameter(DTensor.from_local(w.detach().to_local(), mesh, [Replicate(), Partial()]))
    elif case == "no dp_mesh_dims":  # full_dtensor parameters, but the dp sub-mesh alone
        kw = {"mesh": mesh["dp_shard"]}
    with pytest.raises(ValueError) as refused:
        fsdp.fully_shard(block, **kw)
    assert not isinstance(block, fsdp.FSDPModule)  # nothing was built
    return str(refused.value)


@pytest.mark.parametrize(
    "case, words",
    [
        ("shard on a dp dim", ["'up.weight'", "Shard(dim=1)", "'dp_shard'", "Replicate()", "redistribute"]),
        ("shard on the replicate dim", ["'up.weight'", "'dp_replicate'", "Replicate()"]),
        ("dp dim on another mesh", ["'up.weight'", "full mesh", "mesh="]),
        ("partial on tp", ["'up.weight'", "Partial placement"]),
        ("no dp_mesh_dims", ["'norm.weight'", "dp_mesh_dims=DataParallelMeshDims(shard='dp_shard')"]),
        ("shard dims apart", ["'norm.weight'", "['dp_shard', 'cp']", "adjacent"]),
    ],
)
def test_misuse_raises_before_any_collective(case: str, words: list[str]) -> None:
    """Every rank raises the same ValueError naming the parameter, the dim and the fix (a
    collective on some ranks only would hang the threaded world until the harness's timeout)."""
    messages = run_ranks(_misuse, 4, case, backend="threaded", timeout=60)
    assert len(set(messages)) == 1, messages
    for word in words:
        assert word in messages[0], messages[0]


def _tp_sub_mesh(ref: nn.Module, with_dims: bool) -> dict:
    """The TP recipe on a sub-mesh (parallelize_module on mesh['tp']), sharded with the full mesh
    and dp_mesh_dims or with mesh['dp_shard'] alone."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    model = copy.deepcopy(ref)
    kw = {"mesh": mesh, "dp_mesh_dims": fsdp.DataParallelMeshDims(shard="dp_shard")} if with_dims else {"mesh": mesh["dp_shard"]}
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"gate": ColwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()})
        fsdp.fully_shard(block, **kw)
    fsdp.fully_shard(model, **kw)
    x, y = make_batches(1)[0]
    rank = mesh["dp_shard"].get_local_rank()
    F.cross_entropy(model(x[rank * 8 : (rank + 1) * 8]).reshape(-1, VOCAB), y[rank * 8 : (rank + 1) * 8].reshape(-1)).backward()
    return {
        "placements": {n: (tuple(p.placements), p.device_mesh.mesh_dim_names) for n, p in model.named_parameters()},
        "params": {n: _full(p) for n, p in model.named_parameters()},
        "grads": {n: _full(p.grad) for n, p in model.named_parameters()},
    }


def test_tp_on_a_sub_mesh_with_dp_mesh_dims_is_the_sub_mesh_recipe() -> None:
    """Parameters tensor-parallel on mesh['tp'] (FSDP2 wants them on the full mesh under
    dp_mesh_dims; fsdp also takes them): sharded, gathered and reduced exactly as with
    fully_shard(mesh=mesh['dp_shard'])."""
    model = make_model()
    with_dims = run_ranks(_tp_sub_mesh, 4, model, True, backend="threaded")
    without = run_ranks(_tp_sub_mesh, 4, model, False, backend="threaded")
    for a, b in zip(with_dims, without):
        assert a["placements"] == b["placements"]
        assert a["placements"]["blocks.0.down.weight"][1] == ("dp_shard", "tp")
        assert _max_diff(a["params"], dict(model.named_parameters())) == 0.0
        assert _max_diff(a["grads"], b["grads"]) == 0.0


# ----------------------------------------------------------------------------- checkpoints


def _checkpoint(ref: nn.Module, other: nn.Module, batches, path: str, full: dict) -> dict:
    """Save fsdp's full-mesh parameters and AdamW state (DCP) after a step; load them into fsdp
    (another model, stepped once) and into FSDP2 (same dp_mesh_dims); and load a full state dict."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    import fsdp.checkpoint as ckpt

    shape, names, dims = (2, 2), ("dp_shard", "tp"), fsdp.DataParallelMeshDims(shard="dp_shard")
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    rank, size = _dp_rank(mesh, dims)

    def build(model: nn.Module, impl: str):
        model = distribute_full(copy.deepcopy(model), mesh)
        _shard(model, mesh, dims, impl)
        return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)

    def step(model, opt, x, y) -> float:
        per = x.shape[0] // size
        loss = _local_loss(model, x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per], mesh, dims)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return float(loss)

    out = {}
    model, opt = build(ref, "fsdp")
    step(model, opt, *batches[0])
    msd, osd = ckpt.get_state_dict(model, opt)
    ckpt.save({"model": msd, "optim": osd}, path)
    out["saved"] = {n: _full(p) for n, p in model.named_parameters()}
    out["saved_next_loss"] = step(model, opt, *batches[1])

    mine, mine_opt = build(other, "fsdp")
    step(mine, mine_opt, *batches[0])  # optimizer state exists (and differs) before the load
    msd, osd = ckpt.get_state_dict(mine, mine_opt)
    state = {"model": msd, "optim": osd}
    ckpt.load(state, path)
    ckpt.set_state_dict(mine, mine_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    out["loaded"] = {n: _full(p) for n, p in mine.named_parameters()}
    out["loaded_next_loss"] = step(mine, mine_opt, *batches[1])

    theirs, _ = build(other, "torch")
    sd = get_model_state_dict(theirs)
    dcp.load({"model": sd}, checkpoint_id=path)
    theirs.load_state_dict(sd)
    out["fsdp2_loaded"] = {n: _full(p) for n, p in theirs.named_parameters()}

    again, _ = build(other, "fsdp")
    ckpt.set_state_dict(again, model_state_dict=full, options=StateDictOptions(full_state_dict=True))
    out["full_loaded"] = {n: _full(p) for n, p in again.named_parameters()}
    return out


def test_checkpoint_of_full_mesh_parameters_round_trips(tmp_path) -> None:
    """DCP save of fsdp's full-mesh parameters (dp_shard 2 x tp 2) loads bit for bit into fsdp
    (optimizer state included: the next step's loss is the same) and into FSDP2 with the same
    dp_mesh_dims; a full state dict loads exactly into the full-mesh parameters."""
    model, other, batches = make_model(), make_model(seed=7), make_batches(2)
    full = dict(model.state_dict())
    for r in run_ranks(_checkpoint, 4, model, other, batches, str(tmp_path / "ckpt"), full, backend="threaded"):
        assert _max_diff(r["loaded"], r["saved"]) == 0.0
        assert _max_diff(r["fsdp2_loaded"], r["saved"]) == 0.0
        assert _max_diff(r["full_loaded"], dict(model.named_parameters())) == 0.0
        assert r["loaded_next_loss"] == r["saved_next_loss"]


# ----------------------------------------------------------------------------- meta-device build


def _meta_build(ref: nn.Module, how: str) -> tuple[dict, float]:
    """torchtitan's order: build on meta, distribute on the full mesh, fully_shard, to_empty, then
    initialise: fsdp.init_weights (full tensors per unit) or FSDP2's way (in place on the sharded
    parameters)."""
    shape, names, dims = (2, 2), ("dp_shard", "tp"), fsdp.DataParallelMeshDims(shard="dp_shard")
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    with torch.device("meta"):
        model = distribute_full(make_model(), mesh)
    _shard(model, mesh, dims, "fsdp")
    model.to_empty(device="cpu")
    values = dict(ref.named_parameters())
    with torch.no_grad():
        if how == "init_weights":
            prefix = {id(m): (n + "." if n else "") for n, m in model.named_modules()}

            def copy_in(m: nn.Module) -> None:  # the unit's parameters as the module computes with them
                for name, p in m.named_parameters(recurse=False):
                    assert p.device_mesh == mesh and all(isinstance(q, Replicate) for q in p.placements[:1])
                    p.copy_(distribute_tensor(values[prefix[id(m)] + name].detach(), mesh, p.placements, src_data_rank=None))

            fsdp.init_weights(model, copy_in)
        else:
            for name, p in model.named_parameters():
                p.copy_(distribute_tensor(values[name].detach(), p.device_mesh, p.placements, src_data_rank=None))
    x, y = make_batches(1)[0]
    rank, size = _dp_rank(mesh, dims)
    per = x.shape[0] // size
    loss = _local_loss(model, x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per], mesh, dims)
    return {n: _full(p) for n, p in model.named_parameters()}, float(loss)


@pytest.mark.parametrize("how", ["init_weights", "in place"])
def test_meta_device_build_of_full_mesh_parameters(how: str) -> None:
    """Built on meta (dp_shard 2 x tp 2), materialised with to_empty and initialised: every
    parameter's full_tensor() is the eager model's, and so is the loss on this rank's batch."""
    model = make_model()
    x, y = make_batches(1)[0]
    with torch.no_grad():
        want = [float(F.cross_entropy(model(xm).reshape(-1, VOCAB), ym.reshape(-1))) for xm, ym in zip(x.chunk(2), y.chunk(2))]
    for rank, (got, loss) in enumerate(run_ranks(_meta_build, 4, model, how, backend="threaded")):
        assert _max_diff(got, dict(model.named_parameters())) == 0.0
        assert math.isclose(loss, want[rank // 2], rel_tol=1e-6)
