"""MoE expert weights sharded by whole experts, alone and with expert parallelism (EP).

The stacked expert weights ``w_in [E, DIM, HIDDEN]`` / ``w_out [E, HIDDEN, DIM]`` of
:mod:`tests.fsdp.moe` go into a ``per_tensor`` :class:`fsdp.Bucket`: one collective per tensor,
each split evenly along dim 0, so every rank holds whole experts, with no padding, as a plain
``Shard(0)`` DTensor. Parity is against one process training the same model on the global
batch (AdamW, fp32). AdamW is nearly blind to a gradient off by a constant factor (it divides
by the gradient's own scale), so every step's reduced gradients are compared as well.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import fsdp
from tests.fsdp.models import full_state, make_batches, max_diff, train
from tests.fsdp.moe import EXPERTS, MoEBlock, MoELM
from tests.harness import run_ranks

STEPS = 4
TOL = 1e-5
Grads = dict[str, torch.Tensor]


def reference_run(batches) -> tuple[list[Grads], Grads]:
    """Single-process training on the global batch: the gradients before every step, and the
    final weights."""
    model, grads = MoELM(), []
    train(model, batches, before_step=lambda m: grads.append({n: p.grad.clone() for n, p in m.named_parameters()}))
    return grads, full_state(model)


def gather_full(model: nn.Module, ep_group: Optional[dist.ProcessGroup], grads: bool = False) -> Grads:
    """Every parameter (or its gradient) as the full single-process tensor. A DTensor gives its
    ``full_tensor()``; under EP that is only this EP rank's experts ``[E/ep, ...]``, so expert
    tensors are then concatenated over the EP group in EP-rank order (the order of the experts)."""
    out = {}
    for name, p in model.named_parameters():
        t = p.grad if grads else p
        t = (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().contiguous()
        if ep_group is not None and ".experts." in name:
            pieces = [torch.empty_like(t) for _ in range(dist.get_world_size(ep_group))]
            dist.all_gather(pieces, t, group=ep_group)
            t = torch.cat(pieces)
        out[name] = t.clone()
    return out


def check_whole_experts(model: MoELM, full: MoELM, mesh: DeviceMesh, first: int, count: int) -> None:
    """In every block this rank holds experts ``[first, first + count)`` of each stacked tensor:
    a plain ``Shard(0)`` DTensor over ``mesh`` whose local piece is exactly those experts, in a
    buffer of its own with no padding."""
    for b, block in enumerate(model.blocks):
        for name, p in block.experts.named_parameters():
            want = full.get_parameter(f"blocks.{b}.experts.{name}")[first : first + count]
            assert type(p) is DTensor and p.device_mesh == mesh and p.placements == (Shard(0),), (name, p.placements)
            assert torch.equal(p.to_local(), want), name
            (group,) = [g for g in block._fsdp_state.groups if any(q is p for q in g.sharded_params)]
            assert len(group.infos) == 1 and group.main.layout.padding_numel == 0, name
            assert group.main.local_buffer.numel() == want.numel(), name


def train_recording_grads(model: nn.Module, batches, ep_group: Optional[dist.ProcessGroup] = None) -> list[Grads]:
    """Train on this rank's slice of each batch; return the full reduced gradients of every step."""
    grads: list[Grads] = []
    train(
        model,
        batches,
        rank=dist.get_rank(),
        world=dist.get_world_size(),
        before_step=lambda m: grads.append(gather_full(m, ep_group, grads=True)),
    )
    return grads


# ----------------------------------------------------------------------------- (a) FSDP only


def _expert_dim_fsdp(full: MoELM, batches, ref_grads: list[Grads], ref: Grads) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    model = MoELM()
    for block in model.blocks:
        fsdp.fully_shard(block, mesh=mesh, buckets=[fsdp.Bucket(["*.w_in", "*.w_out"], per_tensor=True)])
    fsdp.fully_shard(model, mesh=mesh)
    per = EXPERTS // world
    check_whole_experts(model, full, mesh, rank * per, per)
    grads = train_recording_grads(model, batches)
    return {"grads": max(map(max_diff, grads, ref_grads)), "weights": max_diff(full_state(model), ref)}


@pytest.mark.parametrize("backend,world", [("gloo", 2), ("threaded", 4)])
def test_expert_dim_sharding_parity(backend: str, world: int) -> None:
    """Each rank holds E/world whole experts; training matches one process on the global batch."""
    batches = make_batches(STEPS)
    ref_grads, ref = reference_run(batches)
    results = run_ranks(_expert_dim_fsdp, world, MoELM(), batches, ref_grads, ref, backend=backend)
    print(f"{backend} world={world}: {results[0]}")
    assert all(r == results[0] for r in results)
    assert results[0]["grads"] <= TOL and results[0]["weights"] <= TOL, results[0]


# ----------------------------------------------------------------------------- (b) FSDP x EP


def _fsdp_x_ep(
    full: MoELM, batches, ref_grads: list[Grads], ref: Grads, shape: tuple[int, int], divide: bool = True
) -> dict:
    """The world as a (fsdp, ep) mesh of ``shape``, e.g. world 4 as (fsdp 2, ep 2).

    EP is the inner axis (neighbouring ranks): its token all-to-alls sit on the critical path of
    every MoE layer, forward and backward, while the FSDP gathers are prefetched behind compute,
    so EP gets the fastest links (the order Megatron-Core and torchtitan use too). Rank
    ``r = ep * f + c``: the EP group of ``r`` is the ranks with its fsdp coordinate ``f``, which
    exchange tokens; the ranks with its EP coordinate ``c`` hold the same experts
    ``[c*E/ep, (c+1)*E/ep)`` and shard them over the fsdp axis.

    Why ``gradient_divide_factor=world``: the reference gradient is ``(1/W) sum_r dL_r/dw`` over
    all W ranks' equal slices. Non-expert weights see only their own rank's tokens, so the
    default average over the world mesh gives it. An expert's local gradient on an EP rank
    already sums ``dL_r/dw`` over every rank ``r`` of its EP group (their tokens came to it), and
    the EP groups along the fsdp axis partition the world, so the sum over the fsdp group is the
    sum over all W ranks: divide by W. The default (average over the fsdp group, W / ep ranks)
    would leave expert gradients ``ep`` times too large, which ``divide=False`` demonstrates."""
    world = dist.get_world_size()
    mesh2d = init_device_mesh("cpu", shape, mesh_dim_names=("fsdp", "ep"))
    world_mesh = init_device_mesh("cpu", (world,))
    ep_group = mesh2d.get_group("ep")
    model = MoELM(ep_group=ep_group)
    experts = fsdp.Bucket(
        "experts.*", mesh=mesh2d["fsdp"], per_tensor=True, gradient_divide_factor=world if divide else None
    )
    for block in model.blocks:
        fsdp.fully_shard(block, mesh=world_mesh, buckets=[experts])
    fsdp.fully_shard(model, mesh=world_mesh)
    per_ep = EXPERTS // mesh2d["ep"].size()
    per = per_ep // mesh2d["fsdp"].size()
    first = mesh2d.get_local_rank("ep") * per_ep + mesh2d.get_local_rank("fsdp") * per
    check_whole_experts(model, full, mesh2d["fsdp"], first, per)
    assert all(p.device_mesh == world_mesh for n, p in model.named_parameters() if ".experts." not in n)
    grads = train_recording_grads(model, batches, ep_group)
    if not divide:
        return {"grads": grads}
    return {"grads": max(map(max_diff, grads, ref_grads)), "weights": max_diff(gather_full(model, ep_group), ref)}


@pytest.mark.parametrize(
    "backend,shape",
    [("threaded", (2, 2)), ("gloo", (2, 2)), ("gloo", (1, 2))],
    ids=["threaded-2x2", "gloo-2x2", "gloo-1x2"],
)
def test_fsdp_x_ep_parity(backend: str, shape: tuple[int, int]) -> None:
    """Experts sharded over fsdp inside each EP rank, the rest over the world: training matches
    one process on the global batch, gradients included. gloo runs the all-to-alls between real
    processes (fsdp 1: the experts are only split by EP)."""
    batches = make_batches(STEPS)
    ref_grads, ref = reference_run(batches)
    world = shape[0] * shape[1]
    results = run_ranks(_fsdp_x_ep, world, MoELM(), batches, ref_grads, ref, shape, backend=backend)
    print(f"{backend} fsdp x ep {shape}: {results[0]}")
    assert all(r == results[0] for r in results)
    assert results[0]["grads"] <= TOL and results[0]["weights"] <= TOL, results[0]


def test_fsdp_x_ep_needs_the_divide_factor() -> None:
    """Control for the derivation in :func:`_fsdp_x_ep`: averaging the expert gradients over the
    fsdp group instead leaves them exactly ep = 2 times the reference, the rest unchanged."""
    batches = make_batches(1)
    ref_grads, ref = reference_run(batches)
    (got,) = run_ranks(_fsdp_x_ep, 4, MoELM(), batches, ref_grads, ref, (2, 2), False, backend="threaded")[0]["grads"]
    want = {n: (2 if ".experts." in n else 1) * g for n, g in ref_grads[0].items()}
    assert max_diff(got, want) <= TOL
    assert max_diff(got, ref_grads[0]) > 1e-3  # and the parity test's bound would catch it


# ----------------------------------------------------------------------------- (c) misuse


def _misuse() -> dict[str, str]:
    """Bad buckets, on rank 0 only: a collective would hang (the other rank has returned), so
    each error must come from the checks that run before any. Returns the messages."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if dist.get_rank() != 0:
        return {}
    cases = {
        # 3 experts over 2 shards cannot be split by whole experts
        "indivisible": (MoEBlock(3, None), [fsdp.Bucket(["*.w_in", "*.w_out"], per_tensor=True)]),
        "matches_nothing": (MoEBlock(EXPERTS, None), [fsdp.Bucket("*.w_gate", per_tensor=True)]),
        "two_buckets": (MoEBlock(EXPERTS, None), [fsdp.Bucket("experts.*"), fsdp.Bucket("*.w_in", per_tensor=True)]),
    }
    out = {}
    for case, (block, buckets) in cases.items():
        with pytest.raises(ValueError) as info:
            fsdp.fully_shard(block, mesh=mesh, buckets=buckets)
        untouched = type(block) is MoEBlock and not any(isinstance(p, DTensor) for p in block.parameters())
        out[case] = str(info.value) if untouched else "the failed call modified the block"
    return out


def test_bucket_misuse_raises_before_any_collective() -> None:
    msgs = run_ranks(_misuse, 2, backend="gloo", timeout=60)[0]
    print(msgs)
    indivisible = msgs["indivisible"]  # names the parameter, its shape and the fix
    assert "'experts.w_in'" in indivisible and "(3, 8, 12)" in indivisible, indivisible
    assert "divisible by 2" in indivisible and "number of experts" in indivisible, indivisible
    assert "matches no parameter" in msgs["matches_nothing"] and "'*.w_gate'" in msgs["matches_nothing"]
    two = msgs["two_buckets"]
    assert "'experts.w_in'" in two and "buckets[0]" in two and "buckets[1]" in two, two


def _misuse_with_ep() -> str:
    """E = 2 over ep = 2 leaves one expert per EP rank, which the fsdp axis (2) cannot split."""
    mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "ep"))
    world_mesh = init_device_mesh("cpu", (4,))
    block = MoEBlock(2, mesh2d.get_group("ep"))
    if dist.get_rank() != 0:
        return ""
    bucket = fsdp.Bucket("experts.*", mesh=mesh2d["fsdp"], per_tensor=True, gradient_divide_factor=4)
    with pytest.raises(ValueError) as info:
        fsdp.fully_shard(block, mesh=world_mesh, buckets=[bucket])
    return str(info.value)


def test_ep_local_experts_must_divide_over_fsdp() -> None:
    msg = run_ranks(_misuse_with_ep, 4, backend="threaded", timeout=60)[0]
    assert "'experts.w_in'" in msg and "(1, 8, 12)" in msg and "divisible by 2" in msg, msg
