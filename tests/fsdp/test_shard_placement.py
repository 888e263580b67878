"""shard_placement_fn (torch FSDP2's), and fully_shard's default layout: Shard(dim) pieces are
exactly torch.chunk's, as plain DTensors (Shard(0) without a shard_placement_fn); training matches one process on the global batch; DCP saves and loads them (into the
default layout too); bad placements raise naming the parameter, on every rank, changing nothing."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import fsdp
import fsdp.checkpoint as ckpt
from tests.fsdp.models import VOCAB, full_state, loss_fn, make_batches, make_model, max_diff, reference, train
from tests.harness import run_ranks

STEPS = 3


class Odd(nn.Module):
    """Dims torch.chunk splits unevenly on 2 and 4 ranks (short and empty pieces)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 5)
        self.mix = nn.Linear(5, 3)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 3))
        self.head = nn.Linear(3, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(tokens))) * self.scale)


def make_odd(seed: int = 0) -> Odd:
    torch.manual_seed(seed)
    return Odd()


def all_dim0(p):
    return Shard(0)


def last_dim(p):
    return Shard(-1)  # normalised to p.dim() - 1


def largest_or_default(p):
    """Matrices along their largest dim (dim 1 on ties), vectors in the default layout."""
    if p.dim() < 2:
        return None
    return Shard(0 if p.shape[0] > p.shape[1] else 1)


# "default": no shard_placement_fn at all: fully_shard's default layout is FSDP2's Shard(0) pieces.
FNS = {"dim0": all_dim0, "last": last_dim, "mixed": largest_or_default, "default": None}


def _shard(model, fn, mesh=None, **kw):
    kw = dict(kw, shard_placement_fn=fn, mesh=mesh)
    for sub in getattr(model, "blocks", [model.mix] if isinstance(model, Odd) else []):
        fsdp.fully_shard(sub, **kw)
    return fsdp.fully_shard(model, **kw)


def _check_pieces(model, full: dict, fn, mesh, atol: float = 0.0) -> None:
    """Every parameter fn places is a plain DTensor whose local piece is torch.chunk's of ``full``."""
    world, rank = mesh.shape[-1], mesh.get_coordinate()[-1]
    lead = [Replicate()] * (mesh.ndim - 1)
    for name, p in model.named_parameters():
        want = fn(p)
        if want is None:
            continue
        dim = want.dim % p.dim()
        assert type(p) is DTensor and list(p.placements) == lead + [Shard(dim)], (name, type(p), p.placements)
        pieces = torch.chunk(full[name], world, dim)
        expected = pieces[rank] if rank < len(pieces) else full[name].narrow(dim, 0, 0)
        local = p.to_local()
        assert local.shape == expected.shape and local.is_contiguous(), (name, local.shape, expected.shape)
        assert torch.allclose(local, expected, rtol=0, atol=atol), name


def _parity(models, batches, refs, hsdp: bool) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard")) if hsdp else init_device_mesh("cpu", (world,))
    out = {}
    for (kind, model), ref in zip(models.items(), refs):
        for fn_name, fn in FNS.items():
            for strategy, micro in (("optim_grads_params", 1), ("optim", 2)):
                m = _shard(copy.deepcopy(model), fn, mesh, sharding_strategy=strategy)
                _check_pieces(m, {n: p.detach() for n, p in model.named_parameters()}, fn or all_dim0, mesh)
                train(m, batches, rank=rank, world=world, micro=micro)
                _check_pieces(m, ref, fn or all_dim0, mesh, atol=1e-5)
                out[(kind, fn_name, strategy)] = max_diff(full_state(m), ref)
    return out


@pytest.mark.parametrize("backend,world,hsdp", [("threaded", 2, False), ("threaded", 4, False), ("gloo", 2, False), ("threaded", 4, True)])
def test_chunk_pieces_and_training_parity(backend, world, hsdp) -> None:
    models = {"tinylm": make_model(), "odd": make_odd()}
    batches = make_batches(STEPS)
    refs = [reference(m, batches) for m in models.values()]
    results = run_ranks(_parity, world, models, batches, refs, hsdp, backend=backend, timeout=180)
    assert all(r == results[0] for r in results)
    for key, diff in results[0].items():
        print(f"{backend} world={world} hsdp={hsdp} {key}: max|d|={diff:.3g}")
    bad = {k: v for k, v in results[0].items() if not v <= 1e-5}
    assert not bad, bad


def _dcp_round_trip(model, other, batches, root: str) -> dict:
    """Train with chunk pieces, save with DCP; load into a differently initialised model with
    chunk pieces and into one with the default layout; both go on training like the saver."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    m = _shard(copy.deepcopy(model), largest_or_default)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    train_steps(m, opt, batches[:2], rank, world)
    msd, osd = get_state_dict(m, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(root, "ck"))
    train_steps(m, opt, batches[2:], rank, world)
    want = full_state(m)
    for name, fn in (("chunk", last_dim), ("default", None)):
        n = _shard(copy.deepcopy(other), fn)
        nopt = torch.optim.AdamW(n.parameters(), lr=1e-2)
        train_steps(n, nopt, batches[:1], rank, world)  # optimizer state exists, with other values
        msd, osd = get_state_dict(n, nopt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=os.path.join(root, "ck"))
        set_state_dict(n, nopt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        train_steps(n, nopt, batches[2:], rank, world)
        out[name] = max_diff(full_state(n), want)
    # a full state dict (rank 0's) loaded by fsdp.checkpoint.set_state_dict into Shard(1) pieces
    full = ckpt.get_state_dict(m, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    n = _shard(copy.deepcopy(other), last_dim)
    nopt = torch.optim.AdamW(n.parameters(), lr=1e-2)
    train_steps(n, nopt, batches[:1], rank, world)
    ckpt.set_state_dict(
        n, nopt, model_state_dict=full[0], optim_state_dict=full[1],
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )
    _check_pieces(n, want, last_dim, n.head.weight.device_mesh)
    out["full"] = max_diff(full_state(n), want)
    return out


def train_steps(m, opt, batches, rank: int, world: int) -> None:
    for x, y in batches:
        per = x.shape[0] // world
        loss_fn(m, x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("kind", ["tinylm", "odd"])
def test_dcp_save_load_into_chunk_and_default_layouts(tmp_path, kind) -> None:
    make = make_model if kind == "tinylm" else make_odd
    results = run_ranks(_dcp_round_trip, 2, make(), make(seed=7), make_batches(4), str(tmp_path), backend="gloo", timeout=180)
    print(results[0])
    assert all(diff <= 1e-6 for diff in results[0].values()), results[0]


def _errors(model) -> dict:
    out = {}
    cases = {
        "replicate": (lambda p: Replicate(), TypeError),
        "not a placement": (lambda p: 0, TypeError),
        "dim 2": (lambda p: Shard(2) if p.dim() == 2 else None, ValueError),
        "dim -2 of a vector": (lambda p: Shard(-2), ValueError),
    }
    for case, (fn, error) in cases.items():
        m = copy.deepcopy(model)
        with pytest.raises(error) as info:
            fsdp.fully_shard(m, shard_placement_fn=fn)
        out[case] = str(info.value)
        assert not isinstance(m, fsdp.FSDPModule)
        assert not any(isinstance(p, DTensor) for p in m.parameters())  # nothing changed
    with pytest.raises(TypeError, match="shard_placement_fn must be a callable"):
        fsdp.fully_shard(copy.deepcopy(model), shard_placement_fn=Shard(0))
    with pytest.raises(ValueError, match="buckets\\[0\\]"):
        fsdp.fully_shard(copy.deepcopy(model), shard_placement_fn=all_dim0, buckets=[fsdp.Bucket("mix.*")])
    return out


def test_bad_placements_raise_naming_the_parameter_on_every_rank() -> None:
    results = run_ranks(_errors, 2, make_odd(), backend="threaded", timeout=60)
    assert results[0] == results[1]
    msgs = results[0]
    # 'scale' is registered on the root itself, so it comes first
    assert "'scale'" in msgs["replicate"] and "return Shard(dim)" in msgs["replicate"]
    assert "'scale'" in msgs["not a placement"]
    assert "Shard dim 2 is invalid for 2D tensor" in msgs["dim 2"] and "'embed.weight'" in msgs["dim 2"]
    assert "Shard dim -2 is invalid for 1D tensor" in msgs["dim -2 of a vector"] and "'scale'" in msgs["dim -2 of a vector"]


def _meta_and_dtype(model, batches) -> dict:
    """Built on meta and initialised by init_weights: the eager model's torch.chunk pieces;
    ``.to(torch.float64)`` keeps them (as float64) and training on matches the float64 reference;
    bf16 compute weights gather into their shapes (no exactness claim, only agreement)."""
    from tests.fsdp.test_meta_init import _init

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    with torch.device("meta"):
        m = type(model)()
    _shard(m, largest_or_default, mesh)
    m.to_empty(device="cpu")
    fsdp.init_weights(m, _init)
    full = {n: p.detach() for n, p in model.named_parameters()}
    _check_pieces(m, full, largest_or_default, mesh)
    m.to(torch.float64)
    _check_pieces(m, {n: t.double() for n, t in full.items()}, largest_or_default, mesh)
    train(m, batches, rank=rank, world=world)
    ref = reference(copy.deepcopy(model).double(), batches)
    out = {"float64": max_diff(full_state(m), ref)}
    policy = fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    b = _shard(copy.deepcopy(model), last_dim, mesh, mp_policy=policy)
    train(b, batches, rank=rank, world=world)
    out["bf16"] = max_diff(full_state(b), reference(model, batches))
    return out


def test_meta_init_to_dtype_and_bf16_compute() -> None:
    model, batches = make_model(), make_batches(STEPS)
    results = run_ranks(_meta_and_dtype, 2, model, batches, backend="gloo", timeout=120)  # own RNG per rank
    print(results[0])
    assert all(r == results[0] for r in results)
    assert results[0]["float64"] <= 1e-10 and results[0]["bf16"] < 0.1, results[0]
