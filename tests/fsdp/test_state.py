"""Per-unit hooks: storage freed after forward/backward, gradient sync control, prefetch,
forward order vs registration order, tied embeddings, determinism."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import fsdp
from tests.fsdp.models import full_state, loss_fn, make_batches, make_model, max_diff, reference, train
from tests.fsdp.test_parity import STRATEGIES, shard
from tests.harness import run_ranks


def _released(unit) -> list[bool]:
    return [g.weights.unsharded.is_storage_released() for g in unit._fsdp_state.groups]


def _storage(model, batches) -> bool:
    m = shard(copy.deepcopy(model), True)  # optim_grads_params
    x, y = batches[0]
    assert all(_released(m)) and all(all(_released(b)) for b in m.blocks)
    loss = loss_fn(m, x, y)
    for block in m.blocks:  # resharded after forward: size 0
        assert all(_released(block))
        assert all(g.weights.unsharded.local_buffer.untyped_storage().nbytes() == 0 for g in block._fsdp_state.groups)
        assert all(isinstance(p, torch.distributed.tensor.DTensor) for p in block.parameters())
    assert not any(_released(m))  # the root keeps its weights for the backward that follows
    loss.backward()
    for unit in [m, *m.blocks]:
        assert all(_released(unit))
        assert all(g.grads.grad_in.is_storage_released() for g in unit._fsdp_state.groups)
    with torch.no_grad():  # as in FSDP2: the blocks reshard, the root keeps its gathered weights
        loss_fn(m, x, y)
    assert all(all(_released(b)) for b in m.blocks) and not any(_released(m))
    m.reshard()
    assert all(_released(m))
    return True


def test_unsharded_storage_is_released_after_forward_and_backward() -> None:
    model, batches = make_model(), make_batches(1)
    assert all(run_ranks(_storage, 2, model, batches, backend="gloo"))


def _kinds(module) -> set[str]:
    """Which kinds of parameters are registered on the unit's own modules (not nested units')."""
    own = {id(p) for g in module._fsdp_state.groups for p in (*g.sharded_params, *g.unsharded_params)}
    return {"dtensor" if isinstance(p, DTensor) else "plain" for p in module.parameters() if id(p) in own}


def _registration(model, batches) -> dict:
    """What ``module.weight`` is between forward and backward, as in FSDP2: the sharded DTensors
    for units that reshard after forward, the unsharded plain tensors (equal to the full weights)
    for those that do not (by default the root), with and without grad; the sharded ones again
    after backward, after reshard() and for state dicts. One difference: with a backward to come,
    the root at its default (None) frees what only forward reads (its ``nn.Embedding`` weight,
    fsdp.group.forward_only) and registers it sharded, as a resharded unit would."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = batches[0]
    per = x.shape[0] // world
    x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    out = {}
    for raf in (None, True, False):
        m = shard(copy.deepcopy(model), True, reshard_after_forward=raf)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        sharded = list(m.parameters())
        root, block = ("plain" if raf in (None, False) else "dtensor"), ("plain" if raf is False else "dtensor")
        expected = ({root}, {block})
        for grad in (True, False):
            with torch.set_grad_enabled(grad):
                loss = loss_fn(m, x, y)
            embed = isinstance(m.embed.weight, DTensor)
            out[(raf, grad, "embedding sharded")] = embed == (root == "dtensor" or (grad and raf is None))
            root_kinds = {"plain", "dtensor"} if embed and root == "plain" else {root}
            out[(raf, grad, "after_forward")] = (_kinds(m), _kinds(m.blocks[0])) == (root_kinds, expected[1])
            plain = {n: p for n, p in m.named_parameters() if not isinstance(p, DTensor)}
            out[(raf, grad, "plain_is_full")] = all(torch.equal(p, full[n]) for n, p in plain.items())
            if grad:
                loss.backward()
            else:
                for unit in [m, *m.blocks]:
                    unit.reshard()
            out[(raf, grad, "after")] = all(a is b for a, b in zip(m.parameters(), sharded))
        with torch.no_grad():
            loss_fn(m, x, y)
        sd = m.state_dict()  # reshards first, as FSDP2's state-dict hooks do
        out[(raf, "state_dict")] = all(isinstance(v, DTensor) for v in sd.values()) and _kinds(m) == {"dtensor"}
        out[(raf, "optimizer")] = all(a is b for a, b in zip(opt.param_groups[0]["params"], sharded))
    return out


def test_registered_parameters_between_forward_and_backward_follow_reshard_after_forward() -> None:
    result = run_ranks(_registration, 2, make_model(), make_batches(1), backend="threaded")[0]
    assert all(result.values()), {k: v for k, v in result.items() if not v}


def _variants(model, batches, ref) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    # reshard_after_forward=False: blocks keep their weights until the end of backward
    m = shard(copy.deepcopy(model), True, reshard_after_forward=False)
    x, y = batches[0]
    loss = loss_fn(m, x, y)
    assert not any(_released(m.blocks[0]))
    loss.backward()
    assert all(_released(m.blocks[0]))
    m = shard(copy.deepcopy(model), True, reshard_after_forward=False)
    train(m, batches, rank=rank, world=world, micro=2)
    out["no_reshard_after_forward"] = max_diff(full_state(m), ref)
    # reshard_after_forward=True on the root too: it gathers again in backward
    m = shard(copy.deepcopy(model), True, reshard_after_forward=True)
    train(m, batches, rank=rank, world=world, micro=2)
    out["reshard_after_forward_root"] = max_diff(full_state(m), ref)

    # set_requires_gradient_sync(False) on all but the last micro-batch
    for strategy in STRATEGIES:
        m = shard(copy.deepcopy(model), True, sharding_strategy=strategy)
        out[f"no_sync/{strategy}"] = max_diff(full_state(_train_no_sync(m, batches, rank, world)), ref)

    # explicit prefetch lists and no reshard after backward
    m = shard(copy.deepcopy(model), True)
    blocks = list(m.blocks)
    m.set_modules_to_forward_prefetch([blocks[0]])
    for a, b in zip(blocks, blocks[1:]):
        a.set_modules_to_forward_prefetch([b])
        b.set_modules_to_backward_prefetch([a])
    m.set_reshard_after_backward(False)
    train(m, batches, rank=rank, world=world)
    out["explicit_prefetch"] = max_diff(full_state(m), ref)

    # set_is_last_backward(False) defers the wait to finish_grad_sync()
    m = shard(copy.deepcopy(model), True, sharding_strategy="optim_grads")
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    for bx, by in batches:
        per = bx.shape[0] // world
        bx, by = bx[rank * per : (rank + 1) * per], by[rank * per : (rank + 1) * per]
        m.set_is_last_backward(False)
        loss_fn(m, bx, by).backward()
        assert all(p.grad is None for p in m.parameters())
        m.finish_grad_sync()
        opt.step()
        opt.zero_grad()
    out["finish_grad_sync"] = max_diff(full_state(m), ref)
    return out


def _train_no_sync(m, batches, rank, world, micro: int = 4):
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    for x, y in batches:
        per = x.shape[0] // world
        x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        for k, (xm, ym) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
            m.set_requires_gradient_sync(k == micro - 1)
            (loss_fn(m, xm, ym) / micro).backward()
            if k < micro - 1:  # nothing reduced yet
                assert all(p.grad is None for p in m.parameters())
        opt.step()
        opt.zero_grad()
    return m


@pytest.mark.parametrize("backend,world", [("gloo", 2), ("threaded", 4)])
def test_reshard_sync_and_prefetch_controls_keep_parity(backend, world) -> None:
    model, batches = make_model(), make_batches(3)
    ref = reference(model, batches)
    result = run_ranks(_variants, world, model, batches, ref, backend=backend)[0]
    bad = {k: v for k, v in result.items() if not v <= 1e-5}
    assert not bad, bad


def _order_and_determinism(model, batches) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    states = []
    for prefetch in (True, True, False):
        m = shard(copy.deepcopy(model), True)
        if not prefetch:
            for unit in [m, *m.blocks]:
                unit.set_modules_to_forward_prefetch([])
                unit.set_modules_to_backward_prefetch([])
        train(m, batches, rank=rank, world=world, micro=2)
        states.append(full_state(m))
        order = [info.fqn for g in m._fsdp_state.groups for info in g.infos]
        assert order == ["head.weight", "norm.weight", "embed.weight"]  # registration order
        recorded = [s.modules[0] for s in m._fsdp_state.root_ctx.forward_order]
        assert recorded == [m, m.blocks[1], m.blocks[0]]  # forward order
    return {"bitwise_repeat": all(torch.equal(states[0][k], states[1][k]) for k in states[0]),
            "bitwise_prefetch": all(torch.equal(states[0][k], states[2][k]) for k in states[0]),
            "state": states[0]}


def test_forward_order_differs_from_registration_and_runs_are_bitwise_equal() -> None:
    model, batches = make_model(reverse=True), make_batches(3)
    ref = reference(model, batches)
    result = run_ranks(_order_and_determinism, 2, model, batches, backend="gloo")[0]
    assert result["bitwise_repeat"] and result["bitwise_prefetch"]
    assert max_diff(result["state"], ref) <= 1e-5


def _tied(model, batches, ref) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for strategy in STRATEGIES:
        for per_block in (False, True):
            m = shard(copy.deepcopy(model), per_block, sharding_strategy=strategy)
            assert m.head.weight is m.embed.weight
            train(m, batches, rank=rank, world=world)
            assert m.head.weight is m.embed.weight
            out[(strategy, per_block)] = max_diff(full_state(m), ref)
    m = copy.deepcopy(model)
    fsdp.fully_shard(m.head)
    fsdp.fully_shard(m)  # as in FSDP2, the tie split across units raises at the first forward
    try:
        m(batches[0][0])
    except ValueError as e:
        out["across_units_error"] = "already managed by another FSDP unit" in str(e)
    return out


def test_tied_embeddings() -> None:
    model, batches = make_model(tie=True), make_batches(3)
    ref = reference(model, batches)
    result = run_ranks(_tied, 2, model, batches, ref, backend="gloo")[0]
    assert result.pop("across_units_error") is True
    bad = {k: v for k, v in result.items() if not v <= 1e-5}
    assert not bad, bad


def _prefetch_in_flight(model, batches) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    m = shard(copy.deepcopy(model), True)
    b0, b1 = m.blocks
    seen = {"forward": [], "backward": []}

    def during_b0_forward(module, args):  # block 1's gather was launched before block 0 computes
        seen["forward"].append(b1._fsdp_state.groups[0].unsharder.gather_in_flight())

    def during_b1_backward(param):  # block 0 is being gathered while block 1's grads land
        g = b0._fsdp_state.groups[0]
        seen["backward"].append(g.unsharder.gather_in_flight() or not g.weights.unsharded.is_storage_released())

    b0.gate.register_forward_pre_hook(during_b0_forward)
    b1._fsdp_state.groups[0].unsharded_params[0].register_post_accumulate_grad_hook(during_b1_backward)
    train(m, batches, rank=rank, world=world)
    return seen


def test_implicit_prefetch_overlaps_the_next_gather() -> None:
    model, batches = make_model(), make_batches(3)
    seen = run_ranks(_prefetch_in_flight, 2, model, batches, backend="gloo")[0]
    # the first step records the forward order; later steps prefetch along it
    assert seen["forward"] == [False, True, True]
    assert seen["backward"][1:] == [True, True]


def _unused_and_deferred(model, batches, ref) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for strategy in STRATEGIES:
        m = shard(copy.deepcopy(model), True, sharding_strategy=strategy)
        train(m, batches, rank=rank, world=world, micro=2)
        assert m.blocks[0].spare.weight.grad is None  # unused: no gradient, as in one process
        out[f"unused/{strategy}"] = max_diff(full_state(m), ref)

        # reductions of earlier micro-batches left in flight, finished by the last backward
        m = shard(copy.deepcopy(model), True, sharding_strategy=strategy)
        opt = torch.optim.AdamW([p for p in m.parameters()], lr=1e-2, weight_decay=0.1)
        for x, y in batches:
            per = x.shape[0] // world
            x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
            for k, (xm, ym) in enumerate(zip(x.chunk(2), y.chunk(2))):
                m.set_is_last_backward(k == 1)
                (loss_fn(m, xm, ym) / 2).backward()
            opt.step()
            opt.zero_grad()
        out[f"deferred/{strategy}"] = max_diff(full_state(m), ref)
    return out


def test_unused_parameters_and_deferred_reductions() -> None:
    model, batches = make_model(), make_batches(3)
    model.blocks[0].spare = torch.nn.Linear(4, 4)  # registered, never used in forward
    ref = reference(model, batches)
    result = run_ranks(_unused_and_deferred, 2, model, batches, ref, backend="gloo")[0]
    bad = {k: v for k, v in result.items() if not v <= 1e-5}
    assert not bad, bad


def _grad_buffers_in_backward(model, batches, ref) -> tuple[int, float]:
    """Most unit gradient buffers (``grad_in``) alive at once during backward, and parity."""
    rank, world = dist.get_rank(), dist.get_world_size()
    m = shard(copy.deepcopy(model), True)
    units = [m._fsdp_state] + [b._fsdp_state for b in m.blocks]
    groups = [g for u in units for g in u.groups if g.requires_grad]
    most = 0
    for unit in units:
        original = unit._on_group_grads_done

        def watched(group, original=original):
            nonlocal most
            original(group)
            most = max(most, sum(not g.grads.grad_in.is_storage_released() for g in groups))

        unit._on_group_grads_done = watched  # the hooks look the unit's method up at each call
    train(m, batches, rank=rank, world=world)
    return most, max_diff(full_state(m), ref)


def test_backward_keeps_at_most_two_gradient_buffers_alive() -> None:
    model, batches = make_model(blocks=5), make_batches(3)
    ref = reference(model, batches)
    most, diff = run_ranks(_grad_buffers_in_backward, 2, model, batches, ref, backend="threaded")[0]
    assert diff <= 1e-5
    assert 1 <= most <= 2, most  # one in flight plus the one being filled, of 6 units


def _freed_after_training(model, batches) -> bool:
    """Whether a per-block sharded model that ran forward and backward is garbage collected."""
    import gc
    import weakref

    m = shard(copy.deepcopy(model), True)
    train(m, batches[:1], rank=dist.get_rank(), world=dist.get_world_size())
    block = m.blocks[0]._fsdp_state
    refs = [weakref.ref(x) for x in (m, m._fsdp_state, block, block.groups[0])]
    del block
    del m
    gc.collect()
    return all(r() is None for r in refs)


def test_a_trained_model_is_freed() -> None:
    """Gradient hooks live on fsdp's own parameters; if they held their group strongly, the cycle
    would run through autograd's C++ hook table, invisible to the garbage collector, and every
    model built in a long-lived process (this test suite's workers) would stay in memory."""
    assert run_ranks(_freed_after_training, 2, make_model(), make_batches(1)) == [True, True]


def _gradient_buffers_during_backward(model, batches, ref) -> dict:
    """Every group holds autograd's gradients and allocates ``grad_in`` only once it has them
    all: the root's (head first, embedding last) does not live while the blocks reduce, and a
    block's does not exist while its own backward still computes."""
    rank, world = dist.get_rank(), dist.get_world_size()
    m = shard(copy.deepcopy(model), True)
    root = m._fsdp_state.groups[0]
    seen: list[bool] = []  # at each block's completion: root's grad_in released
    early: list[bool] = []  # as each gradient arrives (before fsdp takes it): its group's grad_in released
    for unit in [m._fsdp_state] + [b._fsdp_state for b in m.blocks]:
        original = unit._on_group_grads_done

        def watched(group, original=original):
            if group is not root:
                seen.append(root.grads.grad_in.is_storage_released())
            original(group)

        unit._on_group_grads_done = watched
        for g in unit.groups:
            for p in g.unsharded_params:  # this hook first, fsdp's after it
                p._post_accumulate_grad_hooks.clear()
                p.register_post_accumulate_grad_hook(lambda p, g=g: early.append(g.grads.grad_in.is_storage_released()))
            g.weights.hooks.hook(g.unsharded_params)
    train(m, batches, rank=rank, world=world)
    return {"seen": seen, "early": early, "diff": max_diff(full_state(m), ref)}


def test_gradient_buffers_exist_only_once_a_group_is_complete() -> None:
    model, batches = make_model(blocks=3), make_batches(3)
    ref = reference(model, batches)
    out = run_ranks(_gradient_buffers_during_backward, 2, model, batches, ref, backend="threaded")[0]
    assert out["seen"] == [True] * 9  # 3 blocks x 3 steps: the root's grad_in never lives then
    assert out["early"] and all(out["early"])
    assert out["diff"] <= 1e-5


class _TwoBranches(torch.nn.Module):
    """Two units side by side: a backward through ``b`` alone prefetches ``a`` (the unit before
    it in forward order), and no backward consumes that gather."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(x), self.b(x)


def _branch_loss(out, both: bool) -> torch.Tensor:
    a, b = out
    return a.square().mean() + b.square().mean() if both else b.square().mean()


def _rows(x: torch.Tensor, k: int, ranks: list[int], world: int) -> torch.Tensor:
    """Micro-batch ``k`` (of 2) of each of ``ranks``' rows of ``x``: the reference takes every rank's."""
    per = x.shape[0] // world
    return torch.cat([x[r * per : (r + 1) * per].chunk(2)[k] for r in ranks])


def _train_branches(model, batches, ranks: list[int], world: int, opt):
    """Per step, a micro-batch through both branches, then one through ``b`` only."""
    for x in batches:
        for k in range(2):
            (_branch_loss(model(_rows(x, k, ranks, world)), both=k == 0) / 2).backward()
        opt.step()
        opt.zero_grad()


def _unconsumed_prefetch(model, batches, probe) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    m = copy.deepcopy(model)
    fsdp.fully_shard(m.a), fsdp.fully_shard(m.b), fsdp.fully_shard(m)
    m.set_reshard_after_backward(False)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    _train_branches(m, batches, [rank], world, opt)
    out["trained"] = full_state(m)
    # The backward through b leaves a's prefetch; an in-place change of a's weights follows.
    _branch_loss(m(probe), both=False).backward()
    with torch.no_grad():
        m.a.weight.mul_(0.5)
    out["after_edit"] = m(probe)[0].detach()
    # unshard(async_op=True) of resharded weights, not waited for, then an optimizer step, then
    # a forward.
    _branch_loss(m(probe), both=True).backward()
    m.a.reshard()
    m.a.unshard(async_op=True)
    assert m.a._fsdp_state.groups[0].unsharder.gather_in_flight()
    opt.step()
    out["after_step"] = m(probe)[0].detach()
    return out


def test_a_gather_in_flight_is_never_taken_as_current_after_the_weights_change() -> None:
    """A backward prefetch that no backward consumed (``set_reshard_after_backward(False)``),
    or an ``unshard(async_op=True)`` not waited for, gathered the weights before a change:
    the next forward gathers again (the single-process model is the reference)."""
    torch.manual_seed(0)
    model, probe = _TwoBranches(), torch.randn(4, 8)
    batches = [torch.randn(8, 8) for _ in range(3)]
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    _train_branches(ref, batches, [0, 1], 2, opt)
    trained = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    _branch_loss(ref(probe), both=False).backward()
    with torch.no_grad():
        ref.a.weight.mul_(0.5)
    after_edit = ref(probe)[0].detach()
    _branch_loss(ref(probe), both=True).backward()
    opt.step()
    after_step = ref(probe)[0].detach()
    for got in run_ranks(_unconsumed_prefetch, 2, model, batches, probe, backend="threaded"):
        assert max_diff(got["trained"], trained) < 1e-6
        assert (got["after_edit"] - after_edit).abs().max() < 1e-6
        assert (got["after_step"] - after_step).abs().max() < 1e-6
