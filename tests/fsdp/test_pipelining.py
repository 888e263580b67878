"""Pipeline parallelism over fsdp stages: ``torch.distributed.pipelining`` schedules on a 2-D
(pp 2 x dp 2) mesh of four gloo ranks, each stage's blocks and root sharded with fsdp on the dp
sub-mesh (``fsdp.torch_names()`` on, so the schedule drives the stages as FSDP2 stages: gradient
sync off for all but the end of the step, then ``finalize_backward`` on torch 2.15, or FSDP2's
private post-backward on torch 2.11-2.14, which :mod:`fsdp.unit.pipelining` answers).

Each schedule trains an 8-block MLP for three AdamW steps of four micro-batches per dp rank
(gradients accumulate across micro-batches), and its weights must equal the single-process
model trained on the global batch and the same schedule over torch FSDP2 stages in the same run.
Zero-bubble schedules split backward into an input-gradient and a weight-gradient step; they
need the stages' weights kept between the two (``reshard_after_forward=False``, as torchtitan
shards pipeline stages), for FSDP2 as for fsdp.

On torch 2.11 a schedule's first step warms the p2p links up by sending to every neighbouring
stage, its own rank's included (the V placement puts stages 1 and 2 on one rank); gloo has no
link to itself and fails. Later torch warms up differently; :func:`_without_self_warmup` drops
those self-sends on 2.11 (the stage's data still passes locally, as torch does it).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp
from tests.harness import run_ranks

DIM, BLOCKS, STEPS, MICRO = 16, 8, 3, 4

# name -> (stages per rank, stage placement: "loop" rank r holds r, r + 2; "v" holds r, 3 - r)
SCHEDULES = {
    "Schedule1F1B": (1, "loop"),
    "ScheduleInterleaved1F1B": (2, "loop"),
    "ScheduleInterleavedZeroBubble": (2, "loop"),
    "ScheduleZBVZeroBubble": (2, "v"),
}


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(BLOCKS)])


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, DIM, generator=g), torch.randn(16, DIM, generator=g)) for _ in range(STEPS)]


def _reference(model: nn.Sequential, batches) -> dict[str, torch.Tensor]:
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for x, y in batches:
        _loss(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in ref.named_parameters()}


@contextlib.contextmanager
def _without_self_warmup() -> Iterator[None]:
    """torch 2.11's schedules warm up with p2p ops to this rank too, which gloo cannot run; newer
    torch does not send them. Drop them (a no-op elsewhere)."""
    from torch.distributed.pipelining.stage import _PipelineStageBase

    from dbuffer.torch_version import parse

    if parse(torch.__version__) >= (2, 12):
        yield
        return
    original = _PipelineStageBase._get_init_p2p_neighbors_ops

    def to_others(stage) -> list:
        return [op for op in original(stage) if op.peer != dist.get_rank()]

    _PipelineStageBase._get_init_p2p_neighbors_ops = to_others
    try:
        yield
    finally:
        _PipelineStageBase._get_init_p2p_neighbors_ops = original


def _train(impl: str, schedule: str, model: nn.Sequential, batches) -> dict[str, torch.Tensor]:
    """One implementation's pipeline (``impl``: "fsdp" or "fsdp2"); this rank's stages' full weights."""
    per_rank, placement = SCHEDULES[schedule]
    with fsdp.torch_names(impl == "fsdp"), _without_self_warmup():
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.pipelining import PipelineStage, schedules

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        pp, dp = mesh["pp"], mesh["dp"]
        pp_rank, dp_rank = pp.get_local_rank(), dp.get_local_rank()
        count = 2 * per_rank
        ids = [pp_rank] if per_rank == 1 else ([pp_rank, pp_rank + 2] if placement == "loop" else [pp_rank, 3 - pp_rank])
        size = BLOCKS // count
        keep = "ZeroBubble" in schedule  # the weight-gradient step reads the input step's weights
        stages, modules = [], []
        for sid in ids:
            sub = copy.deepcopy(model[sid * size : (sid + 1) * size])
            for block in sub:
                fully_shard(block, mesh=dp, reshard_after_forward=not keep)
            fully_shard(sub, mesh=dp, reshard_after_forward=not keep)
            assert isinstance(sub, fsdp.FSDPModule) == (impl == "fsdp")
            modules.append(sub)
            stages.append(PipelineStage(sub, sid, count, torch.device("cpu"), group=pp.get_group()))
        run = getattr(schedules, schedule)(stages if per_rank > 1 else stages[0], n_microbatches=MICRO, loss_fn=_loss)
        opt = torch.optim.AdamW([p for m in modules for p in m.parameters()], lr=1e-2)
        for x, y in batches:
            half = x.shape[0] // 2
            x, y = x[dp_rank * half : (dp_rank + 1) * half], y[dp_rank * half : (dp_rank + 1) * half]
            if 0 in ids:
                run.step(x, target=y) if count - 1 in ids else run.step(x)
            else:
                run.step(target=y)
            opt.step()
            opt.zero_grad()
        return {n: p.full_tensor().detach().clone() for m in modules for n, p in m.named_parameters()}


def _both(schedule: str, model: nn.Sequential, batches) -> dict[str, dict]:
    return {impl: _train(impl, schedule, model, batches) for impl in ("fsdp2", "fsdp")}


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_pipeline_schedules_over_fsdp_stages_train_like_one_process(schedule: str) -> None:
    from torch.distributed.pipelining import schedules

    assert hasattr(schedules, schedule), f"torch {torch.__version__} lacks {schedule}"
    model, batches = _model(), _batches()
    ref = _reference(model, batches)
    results = run_ranks(_both, 4, schedule, model, batches, backend="gloo", timeout=300)
    merged: dict[str, dict] = {"fsdp": {}, "fsdp2": {}}
    for r in results:
        for impl, weights in r.items():
            merged[impl].update(weights)
    for impl, weights in merged.items():
        assert weights.keys() == ref.keys(), (impl, sorted(weights))
        diff = max(float((weights[n] - ref[n]).abs().max()) for n in ref)
        print(f"{schedule} {impl}: max|dW| vs one process {diff:.3g}")
        assert diff <= 1e-5, (schedule, impl, diff)
    between = max(float((merged["fsdp"][n] - merged["fsdp2"][n]).abs().max()) for n in ref)
    assert between <= 1e-6, (schedule, between)
