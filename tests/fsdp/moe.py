"""A tiny mixture-of-experts LM for the expert-sharding tests, with optional expert parallelism.

Each block routes every token to its top-``TOP_K`` experts (softmax gates, renormalised over the
chosen ones) and runs each expert on its own tokens with one ``bmm`` over the stacked weights
``w_in [E, DIM, HIDDEN]`` and ``w_out [E, HIDDEN, DIM]``. An expert's capacity is the largest
number of tokens any expert receives, so no token is ever dropped and the result does not
depend on how the tokens are split over ranks: the single-process model is an exact reference.

With ``ep_group`` the rank of EP coordinate ``c`` keeps experts ``[c*E/ep, (c+1)*E/ep)``, sliced
from the same full initial weights, and the tokens travel to the experts (not the other way):
every rank sends all of its tokens, with their gates for the receiver's experts, to every EP
peer; each computes its experts' share for every token it received (zero for tokens routed
elsewhere) and sends it back, and the owner of the tokens sums the shares. Both exchanges are
differentiable all-to-alls, so the backward pass sends gradients the same ways in reverse.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from einops import einsum

from tests.fsdp.models import VOCAB, RMSNorm

DIM, HIDDEN, EXPERTS, TOP_K = 8, 12, 4, 2


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` over equal splits, differentiable: row block ``j`` goes to peer ``j``.
    Its adjoint is the same exchange applied to the gradient (what peer ``j`` received from us
    comes back from peer ``j``), which torch's deprecated ``torch.distributed.nn`` version also
    does; written out here to keep the test free of deprecation warnings."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return AllToAll.apply(grad.contiguous(), ctx.group), None


def route(logits: torch.Tensor, k: int = TOP_K) -> torch.Tensor:
    """Gates ``[T, E]``: the top-k softmax probabilities of each token renormalised to sum to 1,
    zero for the experts it is not routed to (softmax is positive, so nonzero means routed)."""
    probs = logits.float().softmax(-1)
    top, idx = probs.topk(k, dim=-1)
    return torch.zeros_like(probs).scatter(-1, idx, top / top.sum(-1, keepdim=True)).to(logits.dtype)


def run_experts(x: torch.Tensor, gates: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor) -> torch.Tensor:
    """``sum_e gates[t, e] * expert_e(x[t])`` for the experts of ``w_in``/``w_out`` (one per
    column of ``gates``), each run only on its own tokens: token ``t`` takes slot ``c`` in the
    queue of expert ``e`` (its rank among the tokens routed to ``e``), queues are zero-padded to
    the longest, and one ``bmm`` per weight runs every expert at once."""
    routed = gates != 0
    capacity = max(int(routed.sum(0).max()), 1)
    slot = (routed.long().cumsum(0) - 1).clamp(min=0)
    dispatch = F.one_hot(slot, capacity).to(x.dtype) * routed.unsqueeze(-1).to(x.dtype)  # [T, E, C]
    queues = einsum(dispatch, x, "t e c, t d -> e c d")
    out = torch.bmm(F.silu(torch.bmm(queues, w_in)), w_out)  # [E, C, DIM]
    return einsum(dispatch * gates.unsqueeze(-1), out, "t e c, e c d -> t d")


class Experts(nn.Module):
    """The stacked expert weights of one block: all ``num_experts``, or this rank's
    ``num_experts / ep`` consecutive ones when ``ep_group`` is given."""

    def __init__(self, num_experts: int, ep_group: Optional[dist.ProcessGroup] = None) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.ep_group = ep_group
        ep = 1 if ep_group is None else dist.get_world_size(ep_group)
        if num_experts % ep:
            raise ValueError(f"{num_experts} experts cannot be split evenly over an expert-parallel group of {ep}")
        self.num_local = num_experts // ep
        self.first = 0 if ep_group is None else dist.get_rank(ep_group) * self.num_local
        self.w_in = nn.Parameter(torch.empty(self.num_local, DIM, HIDDEN))
        self.w_out = nn.Parameter(torch.empty(self.num_local, HIDDEN, DIM))

    @torch.no_grad()
    def init_from(self, g: torch.Generator) -> None:
        """Draw the weights of all experts, keep this rank's: every EP layout of the same seed
        holds slices of the same full tensors."""
        w_in = torch.randn(self.num_experts, DIM, HIDDEN, generator=g) / DIM**0.5
        w_out = torch.randn(self.num_experts, HIDDEN, DIM, generator=g) / HIDDEN**0.5
        local = slice(self.first, self.first + self.num_local)
        self.w_in.copy_(w_in[local])
        self.w_out.copy_(w_out[local])

    def forward(self, x: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        """``x [T, DIM]`` tokens of this rank, ``gates [T, E]`` over all experts."""
        if self.ep_group is None:
            return run_experts(x, gates, self.w_in, self.w_out)
        ep, tokens = dist.get_world_size(self.ep_group), x.shape[0]
        # Block j of what we send: our tokens with their gates for peer j's experts.
        send = torch.cat([torch.cat([x, g], dim=-1) for g in gates.split(self.num_local, dim=-1)])
        recv = AllToAll.apply(send, self.ep_group)  # block j: peer j's tokens, gates for our experts
        shares = run_experts(recv[:, :DIM], recv[:, DIM:], self.w_in, self.w_out)
        back = AllToAll.apply(shares, self.ep_group)  # block j: peer j's experts' share of our tokens
        return back.view(ep, tokens, DIM).sum(0)


class MoEBlock(nn.Module):
    """Pre-norm residual MoE block: router (``Linear(DIM, E)``) then the experts."""

    def __init__(self, num_experts: int, ep_group: Optional[dist.ProcessGroup]) -> None:
        super().__init__()
        self.norm = RMSNorm(DIM)
        self.router = nn.Linear(DIM, num_experts, bias=False)
        self.experts = Experts(num_experts, ep_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x).reshape(-1, DIM)
        return x + self.experts(h, route(self.router(h))).view_as(x)


class MoELM(nn.Module):
    """Embedding, MoE blocks, norm, head. Weights come from ``seed`` through a private
    generator rather than the global RNG, so ranks running as threads (which share the global
    RNG) build identical models, and an EP model holds slices of the single-process one."""

    def __init__(
        self,
        seed: int = 0,
        blocks: int = 2,
        num_experts: int = EXPERTS,
        ep_group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(MoEBlock(num_experts, ep_group) for _ in range(blocks))
        self.norm = RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self._init(torch.Generator().manual_seed(seed))

    @torch.no_grad()
    def _init(self, g: torch.Generator) -> None:
        self.embed.weight.copy_(torch.randn(VOCAB, DIM, generator=g))
        for block in self.blocks:
            block.router.weight.copy_(torch.randn(block.router.weight.shape, generator=g) / DIM**0.5)
            block.experts.init_from(g)
        self.head.weight.copy_(torch.randn(VOCAB, DIM, generator=g) / DIM**0.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))
