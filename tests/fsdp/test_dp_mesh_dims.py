"""fully_shard with torch's ``dp_mesh_dims`` (2.12+) contract, as torchtitan's ``full_dtensor`` and
``spmd_types`` backends use it.

``full_dtensor``: every parameter is a DTensor on the *full* SPMD mesh, ``Replicate`` on the
data-parallel dims, tensor-parallel placements on the others; the model computes with DTensor
inputs on that mesh. Each layout (1-D dp_shard on world 2; dp_shard x tp 2x2; HSDP dp_replicate x
dp_shard 2x2) trains with fsdp and with torch FSDP2 given the same ``dp_mesh_dims`` in the same
test, and with one process on the global batch: the sharded parameters' mesh, placements and
``full_tensor()``, the losses, the gradients and the updated weights must agree.

``spmd_types``: the parameters are plain tensor-parallel-local tensors and the mesh still has the
tp dim: fsdp shards them over the data-parallel dims (FSDP2 refuses plain parameters with
``dp_mesh_dims``; its ordinary recipe on the dp sub-mesh is the control).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import fsdp
from tests.fsdp.models import VOCAB, make_batches, make_model
from tests.harness import run_ranks
from tests.versions import fsdp2_flattens_shard_dims

# torch 2.12+ (DataParallelMeshDims); on 2.11 each test checks the clear refusal instead (tests/versions.py)
pytestmark = pytest.mark.dp_mesh_dims

# tensor-parallel placements on the tp dim, by parameter name suffix (Megatron's plan on TinyLM's
# blocks and head); every other parameter, and every parameter on a mesh without tp, is Replicate
TP_PLAN = {
    "gate.weight": Shard(0),  # column-parallel
    "up.weight": Shard(0),
    "up.bias": Shard(0),
    "down.weight": Shard(1),  # row-parallel
    "head.weight": Shard(0),  # column-parallel head, logits sharded on the vocabulary
}
STEPS, LR = 2, 1e-2


def _placements(name: str, mesh) -> tuple:
    names = mesh.mesh_dim_names
    out = [Replicate()] * mesh.ndim
    if "tp" in names:
        for suffix, placement in TP_PLAN.items():
            if name.endswith(suffix):
                out[names.index("tp")] = placement
    return tuple(out)


def distribute_full(model: nn.Module, mesh) -> nn.Module:
    """torchtitan's full_dtensor: every parameter a DTensor on the full mesh (no communication:
    each rank keeps its own piece of the identical full value)."""
    for mname, module in model.named_modules():
        for pname, p in list(module.named_parameters(recurse=False)):
            fqn = f"{mname}.{pname}" if mname else pname
            d = distribute_tensor(p.detach(), mesh, _placements(fqn, mesh), src_data_rank=None)
            setattr(module, pname, nn.Parameter(d, requires_grad=p.requires_grad))
    return model


def _dp_names(dims) -> tuple[str, ...]:
    return dims.replicate_names + dims.shard_names


def _batch_placements(mesh, dims) -> list:
    """The tokens: batch split over every dp dim (replicate dims outermost), whole on the others."""
    return [Shard(0) if n in _dp_names(dims) else Replicate() for n in mesh.mesh_dim_names]


def _dp_rank(mesh, dims) -> tuple[int, int]:
    """This rank's index among the data-parallel ranks (replicate-major) and their number."""
    coord, names = mesh.get_coordinate(), mesh.mesh_dim_names
    rank, size = 0, 1
    for n in _dp_names(dims):
        i = names.index(n)
        rank, size = rank * mesh.size(i) + coord[i], size * mesh.size(i)
    return rank, size


def _local_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, mesh, dims) -> torch.Tensor:
    """The forward on DTensor tokens; the loss on this rank's batch (its logits made whole on the
    non-dp dims), so that the dp reduction's average is the global batch's gradient."""
    tokens = DTensor.from_local(x, mesh, _batch_placements(mesh, dims), run_check=False)
    logits = model(tokens)
    logits = logits.redistribute(mesh, _batch_placements(mesh, dims)).to_local()
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _shard(model: nn.Module, mesh, dims, impl: str, bf16: bool = False) -> None:
    if impl == "fsdp":
        shard_fn, policy = fsdp.fully_shard, fsdp.MixedPrecisionPolicy
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy as policy
        from torch.distributed.fsdp import fully_shard as shard_fn
    kw = {"mp_policy": policy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if bf16 else {}
    for block in model.blocks:
        shard_fn(block, mesh=mesh, dp_mesh_dims=dims, **kw)
    shard_fn(model, mesh=mesh, dp_mesh_dims=dims, **kw)


def _train_full_dtensor(ref: nn.Module, batches, shape, names, dims, impl: str, bf16: bool = False,
                        mesh=None) -> dict:
    mesh = mesh or init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = distribute_full(copy.deepcopy(ref), mesh)
    _shard(model, mesh, dims, impl, bf16)
    out = {
        "placements": {n: (tuple(p.placements), p.device_mesh.mesh_dim_names) for n, p in model.named_parameters()},
        "before": {n: _full(p) for n, p in model.named_parameters()},
        "losses": [],
        "grads": [],
    }
    rank, size = _dp_rank(mesh, dims)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    for x, y in batches:
        per = x.shape[0] // size
        loss = _local_loss(model, x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per], mesh, dims)
        loss.backward()
        out["losses"].append(float(loss))
        out["grads"].append({n: _full(p.grad) for n, p in model.named_parameters()})
        # the gradient lives where the parameter does
        out["grad_placements"] = {n: (tuple(p.grad.placements), p.grad.device_mesh) == (tuple(p.placements), p.device_mesh) for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    out["after"] = {n: _full(p) for n, p in model.named_parameters()}
    return out


def _train_fsdp2_then_fsdp(ref: nn.Module, batches, shape, names, dims, bf16: bool = False) -> tuple[dict, dict]:
    """FSDP2 (the control, on a fresh mesh in a fresh rank thread), then fsdp on the same mesh in
    the same thread: DTensor's sharding propagation caches are per thread and cost seconds per
    op to fill on a 2-D mesh, so the second run reuses them (an equal new mesh cannot: the cached
    results name the old mesh, which FSDP2's check that the parameters' mesh is the one passed
    refuses, and fsdp's output DTensors would too)."""
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    theirs = _train_full_dtensor(ref, batches, shape, names, dims, "torch", bf16, mesh)
    ours = _train_full_dtensor(ref, batches, shape, names, dims, "fsdp", bf16, mesh)
    return ours, theirs


def _reference(model: nn.Module, batches, dp: int) -> dict:
    """One process on the global batch (the mean of the dp ranks' equal batches' mean losses)."""
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1)
    out = {"losses": [], "grads": []}
    for x, y in batches:
        pieces = [F.cross_entropy(ref(xm).float().reshape(-1, VOCAB), ym.reshape(-1)) for xm, ym in zip(x.chunk(dp), y.chunk(dp))]
        loss = sum(pieces) / dp
        loss.backward()
        out["losses"].append([float(p) for p in pieces])
        out["grads"].append({n: p.grad.detach().clone() for n, p in ref.named_parameters()})
        opt.step()
        opt.zero_grad()
    out["after"] = {n: p.detach().clone() for n, p in ref.named_parameters()}
    return out


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _check(shape, names, dims, expect: dict, steps: int = STEPS) -> None:
    """fsdp vs FSDP2 (same dp_mesh_dims, same run) vs one process on the global batch."""
    model, batches = make_model(), make_batches(steps)
    world, dp = math.prod(shape), math.prod(shape[names.index(n)] for n in _dp_names(dims))
    want = _reference(model, batches, dp)
    both = run_ranks(_train_fsdp2_then_fsdp, world, model, batches, shape, names, dims, backend="threaded")
    initial = dict(model.named_parameters())
    for rank in range(world):
        a, b = both[rank]
        assert a["placements"] == b["placements"], (a["placements"], b["placements"])
        for fqn, placements in expect.items():
            assert a["placements"][fqn] == (placements, names), (fqn, a["placements"][fqn])
        assert _max_diff(a["before"], initial) == 0.0  # full_tensor() of the sharded parameters, exactly
        assert all(a["grad_placements"].values()), a["grad_placements"]
        dp_rank = _dp_rank_of(rank, shape, names, dims)
        for step in range(steps):
            assert math.isclose(a["losses"][step], b["losses"][step], rel_tol=1e-6), (a["losses"], b["losses"])
            assert math.isclose(a["losses"][step], want["losses"][step][dp_rank], rel_tol=1e-5)
            assert _max_diff(a["grads"][step], b["grads"][step]) <= 1e-6
            assert _max_diff(a["grads"][step], want["grads"][step]) <= 1e-5
        assert _max_diff(a["after"], b["after"]) <= 1e-6
        assert _max_diff(a["after"], want["after"]) <= 1e-5
        assert _max_diff(a["after"], a["before"]) > 1e-3  # trained


def _dp_rank_of(rank: int, shape, names, dims) -> int:
    coord = []
    for size in reversed(shape):
        coord.append(rank % size)
        rank //= size
    coord.reverse()
    out = 0
    for n in _dp_names(dims):
        i = names.index(n)
        out = out * shape[i] + coord[i]
    return out


def test_full_dtensor_1d_dp_shard_matches_fsdp2_and_single_process() -> None:
    """full_dtensor on a 1-D mesh (dp_shard=2): every parameter Replicate on the mesh; the
    sharded ones Shard(0) on the same mesh, as FSDP2's. (Threaded: in a gloo worker that built an
    equal mesh before, FSDP2's check that the parameters' mesh *is* the one passed fails.)"""
    dims = fsdp.DataParallelMeshDims(shard="dp_shard")
    _check((2,), ("dp_shard",), dims, {"blocks.0.gate.weight": (Shard(0),), "norm.weight": (Shard(0),)})


def test_full_dtensor_dp_shard_x_tp_matches_fsdp2_and_single_process() -> None:
    """dp_shard 2 x tp 2 (threaded world 4): column-parallel weights _StridedShard on dp_shard
    within each TP piece, row-parallel Shard(0) x Shard(1), the rest Shard(0) x Replicate."""
    from torch.distributed.tensor.placement_types import _StridedShard

    dims = fsdp.DataParallelMeshDims(shard="dp_shard")
    expect = {
        "blocks.0.gate.weight": (_StridedShard(0, split_factor=2), Shard(0)),
        "blocks.0.down.weight": (Shard(0), Shard(1)),
        "blocks.0.norm.weight": (Shard(0), Replicate()),
    }
    _check((2, 2), ("dp_shard", "tp"), dims, expect)


def test_full_dtensor_tp_x_dp_shard_mesh_order_matches_fsdp2() -> None:
    """The same with tp as the outer mesh dim (tp 2 x dp_shard 2): the placements follow the
    mesh's own order (a column-parallel weight is Shard(0) on both, tp's split first)."""
    dims = fsdp.DataParallelMeshDims(shard="dp_shard")
    expect = {"blocks.0.gate.weight": (Shard(0), Shard(0)), "blocks.0.down.weight": (Shard(1), Shard(0))}
    _check((2, 2), ("tp", "dp_shard"), dims, expect, steps=1)  # DTensor's first steps on this mesh are slow


def test_full_dtensor_hsdp_matches_fsdp2_and_single_process() -> None:
    """HSDP dp_replicate 2 x dp_shard 2 (threaded world 4): Replicate on dp_replicate, Shard(0)
    on dp_shard, on the full mesh."""
    dims = fsdp.DataParallelMeshDims(shard="dp_shard", replicate="dp_replicate")
    expect = {"blocks.0.gate.weight": (Replicate(), Shard(0))}
    _check((2, 2), ("dp_replicate", "dp_shard"), dims, expect)


def test_full_dtensor_flattened_shard_dims_match_fsdp2_and_single_process() -> None:
    """shard=("dp_shard", "cp") on a 2 x 2 mesh: FSDP2 flattens the two into one shard dim, so
    the sharded parameters live on the flattened mesh (dp_shard_cp=4), Shard(0)."""
    dims = fsdp.DataParallelMeshDims(shard=("dp_shard", "cp"))
    shape, names = (2, 2), ("dp_shard", "cp")
    model, batches = make_model(), make_batches(1)
    want = _reference(model, batches, 4)
    ours = run_ranks(_train_full_dtensor, 4, model, batches, shape, names, dims, "fsdp", backend="threaded")
    theirs = run_ranks(_train_full_dtensor, 4, model, batches, shape, names, dims, "torch", backend="threaded")
    for rank, (r, b) in enumerate(zip(ours, theirs)):
        assert r["placements"]["blocks.0.gate.weight"] == ((Shard(0),), ("dp_shard_cp",))
        if fsdp2_flattens_shard_dims():
            assert r["placements"] == b["placements"]
        else:  # torch 2.12's FSDP2: the full mesh, Shard(0) on each shard dim (the values below agree)
            assert b["placements"] == {k: ((Shard(0), Shard(0)), ("dp_shard", "cp")) for k in r["placements"]}
        assert _max_diff(r["after"], b["after"]) <= 1e-6
        assert r["losses"][0] == pytest.approx(want["losses"][0][rank], rel=1e-5)
        assert _max_diff(r["grads"][0], want["grads"][0]) <= 1e-5
        assert _max_diff(r["after"], want["after"]) <= 1e-5


def test_full_dtensor_bf16_compute_matches_fsdp2() -> None:
    """param_dtype bf16, reduce_dtype fp32 (1-D dp_shard=2): the module computes with bf16
    DTensors on the full mesh; losses, gradients and weights as FSDP2's."""
    dims = fsdp.DataParallelMeshDims(shard="dp_shard")
    model, batches = make_model(), make_batches(STEPS)
    args = (model, batches, (2,), ("dp_shard",), dims)
    ours = run_ranks(_train_full_dtensor, 2, *args, "fsdp", True, backend="threaded")
    theirs = run_ranks(_train_full_dtensor, 2, *args, "torch", True, backend="threaded")
    for a, b in zip(ours, theirs):
        assert a["losses"] == pytest.approx(b["losses"], rel=1e-6)
        assert max(_max_diff(g, h) for g, h in zip(a["grads"], b["grads"])) <= 1e-6
        assert _max_diff(a["after"], b["after"]) <= 1e-6
        assert _max_diff(a["after"], a["before"]) > 1e-3


# ----------------------------------------------------------------------------- spmd_types: plain TP-local parameters


class _TPBoundary(torch.autograd.Function):
    """Megatron's f and g: ``forward_sum`` adds up over tp in forward (a row-parallel output's
    partial sums) and passes the gradient through; otherwise identity in forward (a column-parallel
    input) and the sum over tp of the gradient (each rank's is the part through its own piece)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, forward_sum: bool) -> torch.Tensor:
        ctx.group, ctx.forward_sum = group, forward_sum
        x = x.clone()
        if forward_sum:
            dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if not ctx.forward_sum:
            grad = grad.clone()
            dist.all_reduce(grad, group=ctx.group)
        return grad, None, None


class LocalTPBlock(nn.Module):
    """spmd_types' shape: plain parameters holding this tp rank's piece of a column-parallel
    ``up`` and a row-parallel ``down`` (``tp_mesh`` None: the whole weights, one process), the
    norm replicated; Megatron's f / g around the two (:class:`_TPBoundary`)."""

    def __init__(self, norm: torch.Tensor, up: torch.Tensor, down: torch.Tensor, tp_mesh=None) -> None:
        super().__init__()
        tp, r = (1, 0) if tp_mesh is None else (tp_mesh.size(), tp_mesh.get_local_rank())
        self.norm = nn.Parameter(norm.clone())
        self.up = nn.Parameter(up.chunk(tp, 0)[r].clone())
        self.down = nn.Parameter(down.chunk(tp, 1)[r].clone())
        self.tp_mesh = tp_mesh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm
        if self.tp_mesh is not None:
            h = _TPBoundary.apply(h, self.tp_mesh.get_group(), False)
        out = F.silu(h @ self.up.T) @ self.down.T
        if self.tp_mesh is not None:
            out = _TPBoundary.apply(out, self.tp_mesh.get_group(), True)
        return x + out


class LocalTPModel(nn.Module):
    def __init__(self, ref: nn.Module, tp_mesh=None) -> None:
        super().__init__()
        self.embed = copy.deepcopy(ref.embed)
        self.blocks = nn.ModuleList(
            LocalTPBlock(b.norm.weight.detach(), b.up.weight.detach(), b.down.weight.detach(), tp_mesh) for b in ref.blocks
        )
        self.head = copy.deepcopy(ref.head)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _train_spmd_types(ref: nn.Module, batches, impl: str) -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    model = LocalTPModel(ref, mesh["tp"])
    dims = fsdp.DataParallelMeshDims(shard="dp_shard")
    if impl == "fsdp":  # the full mesh and its dp dims, as torchtitan passes them
        for block in model.blocks:
            fsdp.fully_shard(block, mesh=mesh, dp_mesh_dims=dims)
        fsdp.fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
    else:  # FSDP2 refuses plain parameters with dp_mesh_dims: its recipe on the dp sub-mesh
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp_shard"])
        fully_shard(model, mesh=mesh["dp_shard"])
    out = {"placements": {n: (tuple(p.placements), p.device_mesh.mesh_dim_names) for n, p in model.named_parameters()}}
    out["before"] = {n: _full(p) for n, p in model.named_parameters()}
    rank = mesh["dp_shard"].get_local_rank()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    out["losses"] = []
    for x, y in batches:
        per = x.shape[0] // 2
        xl, yl = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        loss = F.cross_entropy(model(xl).float().reshape(-1, VOCAB), yl.reshape(-1))
        loss.backward()
        out["losses"].append(float(loss))
        opt.step()
        opt.zero_grad()
    out["after"] = {n: _full(p) for n, p in model.named_parameters()}
    return out


def test_spmd_types_plain_tp_local_parameters_on_the_full_mesh() -> None:
    """spmd_types + TP (dp_shard 2 x tp 2): plain TP-local parameters, fully_shard(mesh=<full
    mesh>, dp_mesh_dims=shard 'dp_shard'): sharded over dp_shard only (DTensors on that dim), and
    trained as FSDP2 on the dp sub-mesh and as one process on the global batch."""
    ref, batches = make_model(), make_batches(STEPS)
    whole = LocalTPModel(ref)
    want = _reference(whole, batches, 2)
    ours = run_ranks(_train_spmd_types, 4, ref, batches, "fsdp", backend="threaded")
    theirs = run_ranks(_train_spmd_types, 4, ref, batches, "torch", backend="threaded")
    for rank, (a, b) in enumerate(zip(ours, theirs)):
        tp = rank % 2
        assert a["placements"] == b["placements"]
        assert a["placements"]["blocks.0.up"] == ((Shard(0),), ("dp_shard",))
        assert torch.equal(a["before"]["blocks.0.up"], whole.blocks[0].up.detach().chunk(2, 0)[tp])
        assert a["losses"] == pytest.approx(b["losses"], rel=1e-6)
        assert a["losses"] == pytest.approx([want["losses"][s][rank // 2] for s in range(STEPS)], rel=1e-5)
        assert _max_diff(a["after"], b["after"]) <= 1e-6
        for name, value in a["after"].items():  # this tp rank's piece of the single-process weight
            full = want["after"][name]
            piece = full.chunk(2, 0)[tp] if name.endswith("up") else full.chunk(2, 1)[tp] if name.endswith("down") else full
            assert float((value - piece).abs().max()) <= 1e-5, name
        assert _max_diff(a["after"], a["before"]) > 1e-3
