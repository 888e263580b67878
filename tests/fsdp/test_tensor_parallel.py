"""fully_shard over tensor-parallel DTensor parameters (FSDP x TP on a (dp, tp) mesh).

A Llama-style model (attention wq/wk/wv column-parallel, wo row-parallel; SwiGLU w1/w3
column-parallel, w2 row-parallel; norms, embedding and head plain, so on the dp mesh only) is
trained with TP + fsdp on world 4 = dp 2 x tp 2 and compared with single-process training of the
same model on the global batch, and with torch FSDP2 on the same setup in the same test.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

import fsdp
from fsdp import fully_shard
from tests.harness import run_ranks

VOCAB, DIM, HEADS, HIDDEN, SEQ, BATCH = 16, 8, 2, 12, 4, 8
DP, TP = 2, 2


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) + 0.1 * torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(DIM, DIM, bias=False)
        self.wk = nn.Linear(DIM, DIM, bias=False)
        self.wv = nn.Linear(DIM, DIM, bias=True)
        self.wo = nn.Linear(DIM, DIM, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        head = DIM // HEADS  # heads per rank follow from the (TP-local) projection width
        q, k, v = (w(x).view(b, s, -1, head).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(DIM)
        self.attention = Attention()
        self.ffn_norm = RMSNorm(DIM)
        self.feed_forward = FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, blocks: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(blocks))
        self.norm = RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


TP_PLAN = {
    "attention.wq": ColwiseParallel(),
    "attention.wk": ColwiseParallel(),
    "attention.wv": ColwiseParallel(),
    "attention.wo": RowwiseParallel(),
    "feed_forward.w1": ColwiseParallel(),
    "feed_forward.w3": ColwiseParallel(),
    "feed_forward.w2": RowwiseParallel(),
}


def make_model(seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    return Llama()


def make_batches(steps: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
        for _ in range(steps)
    ]


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).float().reshape(-1, VOCAB), y.reshape(-1))


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _train(model: nn.Module, batches, *, dp_rank: int, micro: int, clip, clip_fn) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    norms = []
    for x, y in batches:
        per = x.shape[0] // DP
        x, y = x[dp_rank * per : (dp_rank + 1) * per], y[dp_rank * per : (dp_rank + 1) * per]
        for xm, ym in zip(x.chunk(micro), y.chunk(micro)):
            (loss_fn(model, xm, ym) / micro).backward()
        norms.append(float(_full(clip_fn(model.parameters(), clip))))
        opt.step()
        opt.zero_grad()
    return norms


def _reference(model: nn.Module, batches, micro: int, clip: float):
    ref = copy.deepcopy(model)
    norms = []
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for x, y in batches:
        # the dp ranks' micro-batches, in the order they sum: same gradient as the global batch
        for xm, ym in zip(x.chunk(DP * micro), y.chunk(DP * micro)):
            (loss_fn(ref, xm, ym) / (DP * micro)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)))
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in ref.named_parameters()}, norms


def _shard(model: nn.Module, mesh, shard_fn) -> None:
    for layer in model.layers:
        parallelize_module(layer, mesh["tp"], TP_PLAN)
        shard_fn(layer, mesh=mesh["dp"])
    shard_fn(model, mesh=mesh["dp"])


def _tp_training(ref: nn.Module, batches, micro: int, clip: float, impl: str):
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    model = copy.deepcopy(ref)
    if impl == "fsdp":
        shard_fn = fully_shard
    else:
        from torch.distributed.fsdp import fully_shard as shard_fn
    _shard(model, mesh, shard_fn)
    placements = {n: (tuple(p.placements), p.device_mesh.mesh_dim_names) for n, p in model.named_parameters()}
    before = {n: _full(p) for n, p in model.named_parameters()}
    norms = _train(model, batches, dp_rank=mesh["dp"].get_local_rank(), micro=micro, clip=clip, clip_fn=fsdp.clip_grad_norm_)
    after = {n: _full(p) for n, p in model.named_parameters()}
    return placements, before, after, norms


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_fsdp_tp_training_matches_single_process_and_fsdp2() -> None:
    model, batches = make_model(), make_batches(4)
    micro, clip = 2, 0.5
    want, want_norms = _reference(model, batches, micro, clip)
    ours = run_ranks(_tp_training, DP * TP, model, batches, micro, clip, "fsdp", backend="threaded")
    theirs = run_ranks(_tp_training, DP * TP, model, batches, micro, clip, "torch", backend="threaded")
    for rank in range(DP * TP):
        placements, before, after, norms = ours[rank]
        # FSDP2's placements: dp split within each TP piece where both shard dim 0
        assert placements == theirs[rank][0], (placements, theirs[rank][0])
        assert placements["layers.0.attention.wq.weight"] == ((_StridedShard(0, split_factor=TP), Shard(0)), ("dp", "tp"))
        assert placements["layers.0.attention.wo.weight"] == ((Shard(0), Shard(1)), ("dp", "tp"))
        assert placements["layers.0.attention.wo.bias"] == ((Shard(0), Replicate()), ("dp", "tp"))
        assert placements["norm.weight"] == ((Shard(0),), ("dp",))
        # full_tensor() of every sharded parameter is the single-process weight, exactly
        assert _max_diff(before, dict(model.named_parameters())) == 0.0
        ours_dev = _max_diff(after, want)
        fsdp2_dev = _max_diff(theirs[rank][2], want)
        assert ours_dev <= max(fsdp2_dev, 1e-5), (ours_dev, fsdp2_dev)
        for got, ref_norm in zip(norms, want_norms):
            assert math.isclose(got, ref_norm, rel_tol=1e-6), (norms, want_norms)
