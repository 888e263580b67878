"""Tiny models and a training loop shared by the fsdp tests (kept small: the test machine is slow)."""

from __future__ import annotations

import copy
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM, HIDDEN, SEQ, BATCH = 16, 8, 12, 4, 16


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # type_as: a weight kept in FP32 under a BF16 policy returns the compute dtype (Llama's norm)
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight).type_as(x)


class Block(nn.Module):
    """Pre-norm residual MLP block (gated, Llama style)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = RMSNorm(DIM)
        self.gate = nn.Linear(DIM, HIDDEN, bias=False)
        self.up = nn.Linear(DIM, HIDDEN, bias=True)
        self.down = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class TinyLM(nn.Module):
    def __init__(self, blocks: int = 2, tie: bool = False, reverse: bool = False) -> None:
        super().__init__()
        self.reverse = reverse
        if reverse:  # registration order opposite to forward order
            self.head = nn.Linear(DIM, VOCAB, bias=False)
            self.norm = RMSNorm(DIM)
            self.blocks = nn.ModuleList(Block() for _ in range(blocks))
            self.embed = nn.Embedding(VOCAB, DIM)
        else:
            self.embed = nn.Embedding(VOCAB, DIM)
            self.blocks = nn.ModuleList(Block() for _ in range(blocks))
            self.norm = RMSNorm(DIM)
            self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in (reversed(self.blocks) if self.reverse else self.blocks):
            x = block(x)
        return self.head(self.norm(x))


class HandedHead(nn.Module):
    """An output projection owning no weight: its caller hands it one (megatron-core's
    ``ColumnParallelLinear(skip_weight_param_allocation=True)``, called with ``weight=``)."""

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight)


class HandedTinyLM(TinyLM):
    """TinyLM tied as megatron-core's GPTModel ties it: the head owns no weight, and the model's
    forward hands it the embedding's (``output_layer(hidden, weight=embedding.weight)``), so the
    tie holds whichever units the embedding and the head belong to."""

    def __init__(self, blocks: int = 2) -> None:
        super().__init__(blocks)
        self.head = HandedHead()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x), weight=self.embed.weight)


def make_model(seed: int = 0, **kw) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(**kw)


def make_batches(steps: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
        for _ in range(steps)
    ]


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))


def train(
    model: nn.Module,
    batches,
    *,
    rank: int = 0,
    world: int = 1,
    micro: int = 1,
    lr: float = 1e-2,
    clip: Optional[float] = None,
    before_step: Optional[Callable[[nn.Module], None]] = None,
    make_opt: Optional[Callable[[list], torch.optim.Optimizer]] = None,
) -> list[float]:
    """AdamW (or ``make_opt(params)``) on this rank's slice of each global batch, ``micro``
    micro-batches per step. Returns the clip norms (if ``clip``) per step."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_opt(params) if make_opt else torch.optim.AdamW(params, lr=lr, weight_decay=0.1)
    norms = []
    for x, y in batches:
        per = x.shape[0] // world
        x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        for xm, ym in zip(x.chunk(micro), y.chunk(micro)):
            (loss_fn(model, xm, ym) / micro).backward()
        if before_step is not None:
            before_step(model)
        if clip is not None:
            n = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            norms.append(float(n.full_tensor() if hasattr(n, "full_tensor") else n))
        opt.step()
        opt.zero_grad()
    return norms


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as a full plain fp32 tensor (gathers DTensors)."""
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = t.detach().float().clone()
    return out


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def reference(model: nn.Module, batches, **kw) -> dict[str, torch.Tensor]:
    ref = copy.deepcopy(model)
    train(ref, batches, **kw)
    return full_state(ref)
