"""Where Megatron-FSDP's conventions differ from FSDP2's, fsdp.megatron follows Megatron-FSDP's, and
each still trains equal to one process on the global batch: the root reshards after forward,
meta parameters get storage on the mesh's device at fully_shard, tied weights are one parameter
under two names, activation recompute leaves every unit resharded, fully_shard_optimizer alone
keeps the compute weights current, a frozen group has no main grads, and per-layer sharding
lowers the training peak below unsharded training (fake world of 8)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.utils.checkpoint import checkpoint

import fsdp
from fsdp.megatron import FsdpModule, MixedPrecisionPolicy, Placements, fully_shard, fully_shard_context
from fsdp.megatron import fully_shard_optimizer
from tests.fsdp.models import TinyLM, full_state, loss_fn, make_batches, make_model, max_diff, reference
from tests.fsdp.test_meta_init import LiveBytes
from tests.harness import run_ranks

ZERO3 = Placements([0], [Shard(0)], [Shard(0)], [Shard(0)])


def _mesh():
    return init_device_mesh("cpu", (dist.get_world_size(),))


def _slice(x, y):
    rank, world = dist.get_rank(), dist.get_world_size()
    per = x.shape[0] // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def _steps(model, batches, opt, between=None) -> None:
    for x, y in batches:
        loss_fn(model, *_slice(x, y)).backward()
        if between is not None:
            between()
        opt.step()
        opt.zero_grad()


def _root_and_meta(model, batches) -> dict:
    """The root alone a unit: after its forward its gathered weights are freed (FSDP2 keeps a
    root's); built on meta, its parameters get storage at fully_shard, are set from the eager
    values, synced, and train."""
    with torch.device("meta"):
        m = TinyLM()
    with fully_shard_context():
        fully_shard(m, _mesh(), ZERO3)
    out = {"materialised": {p.device.type for p in m.parameters()}}
    eager = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(distribute_tensor(eager[name].detach(), p.device_mesh, [Replicate()]))
    (group,) = m.parameter_groups
    group.sync_model_weight_from_main_weight()
    x, y = _slice(*batches[0])
    loss = loss_fn(m, x, y)
    out["freed_after_forward"] = group._unsharded_model_weight.local_buffer.untyped_storage().nbytes() == 0
    out["sharded_after_forward"] = all(isinstance(p, DTensor) for p in m.parameters())
    loss.backward()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    fully_shard_optimizer(opt)
    opt.step()
    opt.zero_grad()
    _steps(m, batches[1:], opt)
    out["state"] = full_state(m)
    return out


def test_the_root_reshards_after_forward_and_meta_parameters_get_storage() -> None:
    model, batches = make_model(), make_batches(2)
    ref = reference(model, batches)
    for r in run_ranks(_root_and_meta, 2, model, batches):
        assert r["materialised"] == {"cpu"} and r["freed_after_forward"] and r["sharded_after_forward"]
        assert max_diff(r["state"], ref) < 1e-5


def _tied(model, batches) -> dict:
    with fully_shard_context():
        for block in model.blocks:
            fully_shard(block, _mesh(), ZERO3)
        fully_shard(model, _mesh(), ZERO3)
    fqns = [p.fqns for g in model.parameter_groups for p in g.fsdp_parameters]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    _steps(model, batches, opt)
    return {"fqns": fqns, "params": len(list(model.parameters())), "state": full_state(model)}


def test_tied_weights_are_one_parameter_under_two_names() -> None:
    model, batches = make_model(tie=True), make_batches(2)
    ref = reference(model, batches)
    for r in run_ranks(_tied, 2, model, batches):
        assert ("embed.weight", "head.weight") in r["fqns"] and r["params"] == len(list(model.parameters()))
        assert max_diff(r["state"], ref) < 1e-5


class Checkpointed(TinyLM):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        return self.head(self.norm(x))


def _recompute(model, batches) -> dict:
    with fully_shard_context():
        for block in model.blocks:
            fully_shard(block, _mesh(), ZERO3)
        fully_shard(model, _mesh(), ZERO3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    seen = []

    def check():
        units = [m for m in model.modules() if isinstance(m, FsdpModule)]
        seen.append(all(isinstance(p, DTensor) for p in model.parameters()) and {u.phase for u in units} == {FsdpModule.Phase.RESTING})

    _steps(model, batches, opt, between=check)
    return {"resharded": seen, "state": full_state(model)}


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_recompute_leaves_every_unit_resharded(reentrant) -> None:
    torch.manual_seed(0)
    model, batches = Checkpointed(reentrant), make_batches(2)
    ref = reference(model, batches)
    for r in run_ranks(_recompute, 2, model, batches):
        assert r["resharded"] == [True, True] and max_diff(r["state"], ref) < 1e-5


class RawSGD(torch.optim.Optimizer):
    """SGD writing through ``.data``, as fused multi-tensor kernels write memory directly: no
    version counter moves, so only a sync tells fsdp the main weights changed."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data.add_(p.grad, alpha=-group["lr"])


def _optimizer_sync(model, batches, hooked: bool) -> dict:
    """ZeRO-2 (compute weights kept whole between steps), fsdp's global optimizer hooks off: only
    fully_shard_optimizer tells the groups the main weights changed (counted per group and step)."""
    zero2 = Placements([0], [Replicate()], [Shard(0)], [Shard(0)])
    was = fsdp.optimizer_step_hooks(False)
    try:
        with fully_shard_context():
            for block in model.blocks:
                fully_shard(block, _mesh(), zero2)
            fully_shard(model, _mesh(), zero2)
        groups = [g for m in model.modules() if isinstance(m, FsdpModule) for g in m.parameter_groups]
        counts = {id(g): 0 for g in groups}
        for g in groups:
            def counted(g=g, sync=g.sync_model_weight_from_main_weight):
                counts[id(g)] += 1
                sync()

            g.sync_model_weight_from_main_weight = counted
        opt = RawSGD(model.parameters())
        if hooked:
            fully_shard_optimizer(opt)
        _steps(model, batches, opt)
        return {"counts": sorted(counts.values()), "state": full_state(model)}
    finally:
        fsdp.optimizer_step_hooks(was)


def test_fully_shard_optimizer_syncs_each_group_once_per_step() -> None:
    model, batches = make_model(), make_batches(3)
    ref = reference(model, batches, make_opt=RawSGD)
    hooked, bare = (run_ranks(_optimizer_sync, 2, model, batches, h)[0] for h in (True, False))
    assert set(hooked["counts"]) == {3} and max_diff(hooked["state"], ref) < 1e-5
    assert set(bare["counts"]) == {0} and max_diff(bare["state"], ref) > 1e-4  # stale compute weights


def _frozen() -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[0].weight.requires_grad_(False)
    with fully_shard_context():
        fully_shard(model, _mesh(), ZERO3)
    model(torch.randn(2, 4)).sum().backward()
    return {g.requires_grad: g.main_grad is None for g in model.parameter_groups}


def test_a_frozen_group_has_no_main_grads() -> None:
    for r in run_ranks(_frozen, 2):
        assert r == {False: True, True: False}


DIM, LAYERS = 64, 8


def _peak(sharded: bool) -> int:
    torch.manual_seed(0)
    with LiveBytes() as tracker:
        model = nn.Sequential(*[nn.Linear(DIM, DIM, dtype=torch.bfloat16) for _ in range(LAYERS)])
        if sharded:
            bf16 = MixedPrecisionPolicy(main_params_dtype=torch.bfloat16, main_grads_dtype=torch.bfloat16)
            with fully_shard_context():
                for layer in model:
                    fully_shard(layer, _mesh(), ZERO3, bf16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x = torch.randn(2, DIM, dtype=torch.bfloat16)
        for _ in range(2):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return tracker.peak


def test_per_layer_sharding_lowers_the_training_peak() -> None:
    """Megatron-FSDP's peak-memory test, on the CPU: live bytes of two training steps of 8 bf16
    layers, per-layer ZeRO-3 at a fake world of 8 against the same training unsharded."""
    sharded = run_ranks(_peak, 8, True, backend="fake")[0]
    plain = _peak(False)
    print(f"peak live bytes: per-layer fsdp.megatron {sharded / 2**10:.0f} KiB, unsharded {plain / 2**10:.0f} KiB")
    assert sharded < plain / 2


def _misuse() -> dict:
    torch.manual_seed(0)
    mesh, grid = _mesh(), init_device_mesh("cpu", (2, 2), mesh_dim_names=("outer", "inner"))
    R, S = Replicate(), Shard(0)
    cases = {
        "zero3 params, Partial grads": lambda: fully_shard(nn.Linear(2, 2), mesh, Placements([0], [S], [Partial("avg")], [S])),
        "a sum gradient": lambda: fully_shard(nn.Linear(2, 2), mesh, Placements([0], [R], [Partial("sum")], [R])),
        "outer-sharded params": lambda: fully_shard(nn.Linear(2, 2), grid, Placements([0, 1], [S, S], [S, S], [S, S])),
        "a subset of dp axes": lambda: fully_shard(nn.Linear(2, 2), grid, Placements([1], [S], [S], [S])),
        "lists of other lengths": lambda: Placements([0], [S, S], [S], [S]),
        "grad_divisor 0": lambda: fully_shard(nn.Linear(2, 2), mesh, ZERO3, grad_divisor=0),
    }
    out = {}
    for name, call in cases.items():
        try:
            call()
            out[name] = None
        except (ValueError, NotImplementedError, TypeError) as e:
            out[name] = type(e).__name__
    model = nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="not finalized"), fully_shard_context():
        fully_shard(model, mesh, ZERO3)
        model(torch.randn(1, 2))  # a forward before the context is left
    with pytest.raises(ValueError, match="already managed"):
        fully_shard(model, mesh, ZERO3)
    with pytest.raises(RuntimeError, match="nesting"), fully_shard_context(), fully_shard_context():
        pass
    return out


def test_misuse_raises_before_any_collective_naming_the_fix() -> None:
    for r in run_ranks(_misuse, 4, backend="threaded"):
        assert r == {
            "zero3 params, Partial grads": "NotImplementedError",
            "a sum gradient": "ValueError",
            "outer-sharded params": "NotImplementedError",
            "a subset of dp axes": "NotImplementedError",
            "lists of other lengths": "ValueError",
            "grad_divisor 0": "ValueError",
        }
