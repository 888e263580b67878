"""A unit with several groups gathers them in one all-gather, as FSDP2 gathers a unit in one.

QLoRA's shape: each block holds a frozen quantised base weight (a tensor subclass with FSDP2's
all-gather extension; the float8 weight of tests/models stands in for torchao's NF4), trainable
low-rank adapters and a frozen norm. fsdp groups them by ``requires_grad`` (the frozen subclass
and norm in one group, the adapters in another); gathered group by group that is two
all-gathers per unit where FSDP2 makes one. Counted against torch FSDP2 in the same run, and
trained against one process on the global batch.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp
from dbuffer import compat
from tests.harness import run_ranks, spy_collectives
from tests.models.float8_weight import Float8RowwiseWeight, STEFloat8Linear

DIM, RANK, BATCH, STEPS = 8, 2, 4, 3


class LoRABlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.base = nn.Linear(DIM, DIM, bias=False)
        self.lora_a = nn.Linear(DIM, RANK, bias=False)
        self.lora_b = nn.Linear(RANK, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + torch.relu(self.base(h) + self.lora_b(self.lora_a(h)))


def make_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(LoRABlock(), LoRABlock(), LoRABlock())
    for block in model:
        nn.init.normal_(block.lora_b.weight, std=0.1)  # non-zero, so the adapters' gradients differ
        block.norm.requires_grad_(False)
    return model


def quantised(model: nn.Module) -> nn.Module:
    """The base weights frozen float8 all-gather subclasses."""
    model = copy.deepcopy(model)
    for block in model:
        block.base.weight = nn.Parameter(Float8RowwiseWeight(block.base.weight.detach().clone()), requires_grad=False)
    return model


def reference(model: nn.Module, data: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """One process, the global batch, the base weights rounded as the float8 gather rounds them."""
    model = copy.deepcopy(model)
    for block in model:
        block.base.__class__ = STEFloat8Linear
        block.base.requires_grad_(False)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for x in data:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


def _train(model: nn.Module, api, data, count, **kw) -> tuple[list[int], dict[str, torch.Tensor], list[int]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    for block in model:
        api.fully_shard(block, mesh=mesh, **kw)
    api.fully_shard(model, mesh=mesh, **kw)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    gathers = []
    for x in data:
        with count() as seen:
            model(x.chunk(world)[rank]).square().mean().backward()
        opt.step()
        opt.zero_grad()
        gathers.append(len(seen))
    trained = {n: p.full_tensor().detach() for n, p in model.named_parameters() if p.requires_grad}
    groups = [len(block._fsdp_state.groups) for block in model] if api is fsdp else []
    return gathers, trained, groups


def _both(model, data) -> dict:
    from torch.distributed import fsdp as torch_fsdp

    ours = _train(quantised(model), fsdp, data, lambda: spy_collectives("all_gather"))
    theirs = _train(quantised(model), torch_fsdp, data, lambda: _counting(dist, compat.all_gather_name()))
    # bucket_size asks for a group per parameter, each with its own collectives: kept apart
    bucketed = _train(quantised(model), fsdp, data, lambda: spy_collectives("all_gather"), bucket_size=1)
    return {"ours": ours, "fsdp2": theirs, "bucketed": bucketed}


class _counting:
    """Count calls of ``module.name`` inside the block (torch FSDP2's all-gathers)."""

    def __init__(self, module, name: str) -> None:
        self.module, self.name, self.calls = module, name, []

    def __enter__(self) -> list:
        real = getattr(self.module, self.name)
        self.real = real

        def counting(*args, **kwargs):
            self.calls.append(1)
            return real(*args, **kwargs)

        setattr(self.module, self.name, counting)
        return self.calls

    def __exit__(self, *exc) -> None:
        setattr(self.module, self.name, self.real)


def test_a_qlora_unit_gathers_once_like_fsdp2_and_trains_like_one_process() -> None:
    world = 2
    model = make_model()
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(BATCH * world, DIM, generator=g) for _ in range(STEPS)]
    want = reference(model, data)
    for r in run_ranks(_both, world, model, data, backend="gloo"):
        (ours_gathers, ours, groups), (fsdp2_gathers, fsdp2, _) = r["ours"], r["fsdp2"]
        assert groups == [2, 2, 2]  # frozen (float8 base + norm) and trainable (adapters)
        # each block once in forward and once in backward (the root holds no parameters)
        assert ours_gathers == fsdp2_gathers == [2 * len(groups)] * STEPS, r
        bucketed_gathers, bucketed, bucketed_groups = r["bucketed"]
        assert bucketed_groups == [5, 5, 5] and bucketed_gathers == [2 * 15] * STEPS
        assert fsdp2_gathers[0] > 0
        for name, w in want.items():
            assert torch.allclose(ours[name], w, atol=1e-5), name
            assert torch.equal(ours[name], fsdp2[name]), name  # same rounding, same reductions
            assert torch.equal(bucketed[name], ours[name]), name
