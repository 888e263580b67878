"""ParameterGroup buffers: which copies exist, alias, are sharded; gradients and norms."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

import fsdp
from tests.fsdp.models import full_state, make_batches, make_model, max_diff, reference, train
from tests.fsdp.test_parity import STRATEGIES, shard
from tests.harness import run_ranks


def _buffers(model) -> dict:
    out = {}
    for strategy in STRATEGIES:
        for policy in (fsdp.MixedPrecisionPolicy(), fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)):
            m = shard(copy.deepcopy(model), False, sharding_strategy=strategy, mp_policy=policy)
            (g,) = m._fsdp_state.groups
            s = g.strategy
            same = policy.param_dtype is None
            assert (g.weights.model is g.main) == same  # the model weights alias the main ones when they can
            assert g.main.placements == ((Shard(0),) if s.shard_optim else (Replicate(),))
            assert g.grads.main_grad.placements == ((Shard(0),) if s.shard_grads else (Replicate(),))
            assert (g.weights.unsharded is g.main) == (strategy == "no_shard" and same)
            assert g.weights.unsharded.is_storage_released() == s.shard_params
            assert g.grads.grad_in.is_storage_released()
            assert g.grads.main_grad.is_storage_released()  # no gradients yet: no main-grad memory
            numel = sum(p.numel() for p in model.parameters())
            if not s.shard_optim:  # replicated everywhere: a one-shard layout, no padding
                assert g.main.layout.num_shards == 1 and g.main.local_buffer.numel() == numel
            for p in m.parameters():
                assert isinstance(p, DTensor) and p.placements == g.main.placements
            # registered parameters are exact views of the main weights
            p0 = next(m.parameters())
            assert p0._local_tensor.untyped_storage().data_ptr() == g.main.local_buffer.untyped_storage().data_ptr()
            out[(strategy, same)] = True
    return out


@pytest.mark.parametrize("backend,world", [("gloo", 2), ("threaded", 4)])
def test_buffers_follow_the_strategy(backend, world) -> None:
    model = make_model()
    assert all(all(r.values()) for r in run_ranks(_buffers, world, model, backend=backend))


def _clip_norms(model, batches) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for strategy in STRATEGIES:
        m = shard(copy.deepcopy(model), True, sharding_strategy=strategy)
        out[strategy] = train(m, batches, rank=rank, world=world, clip=0.5)
    return out


@pytest.mark.parametrize("backend,world", [("gloo", 2), ("threaded", 4)])
def test_clip_grad_norm_matches_single_process(backend, world) -> None:
    model, batches = make_model(), make_batches(3)
    ref = train(copy.deepcopy(model), batches, clip=0.5)
    for strategy, norms in run_ranks(_clip_norms, world, model, batches, backend=backend)[0].items():
        assert len(norms) == len(ref) == 3
        for got, want in zip(norms, ref):
            assert abs(got - want) <= 1e-6 * want, (strategy, norms, ref)


def _frozen(model, batches, ref) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for strategy in STRATEGIES:
        m = copy.deepcopy(model)
        m.embed.weight.requires_grad_(False)
        m.blocks[0].up.bias.requires_grad_(False)
        m = shard(m, True, sharding_strategy=strategy)
        groups = {(g.dtypes.main, g.requires_grad): g for g in m._fsdp_state.groups}
        assert set(groups) == {(torch.float32, True), (torch.float32, False)}
        frozen = groups[(torch.float32, False)]
        assert not hasattr(frozen, "main_grad")
        train(m, batches, rank=rank, world=world)
        assert m.embed.weight.grad is None and not hasattr(m.embed.weight, "main_grad")
        assert not m.embed.weight.requires_grad and m.head.weight.requires_grad
        out[strategy] = max_diff(full_state(m), ref)
    return out


def test_frozen_parameters_get_no_main_grad() -> None:
    model, batches = make_model(), make_batches(3)
    ref_model = copy.deepcopy(model)
    ref_model.embed.weight.requires_grad_(False)
    ref_model.blocks[0].up.bias.requires_grad_(False)
    ref = reference(ref_model, batches)
    for strategy, diff in run_ranks(_frozen, 2, model, batches, ref, backend="gloo")[0].items():
        assert diff <= 1e-5, (strategy, diff)


def _main_grad_views(model, batches) -> bool:
    m = shard(copy.deepcopy(model), True, sharding_strategy="optim_grads_params")
    x, y = batches[0]
    from tests.fsdp.models import loss_fn

    loss_fn(m, x, y).backward()
    for p in m.parameters():
        assert p.main_grad is p.grad  # fp32 main grads: .grad is the main-grad view itself
    m.zero_grad_buffer()
    assert all(float(p.grad._local_tensor.abs().sum()) == 0 for p in m.parameters())
    return True


def test_main_grad_and_zero_grad_buffer() -> None:
    model, batches = make_model(), make_batches(1)
    assert all(run_ranks(_main_grad_views, 2, model, batches, backend="threaded"))


def sgd_momentum(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, foreach=False)


def adamw_for_loop(params):
    return torch.optim.AdamW(params, lr=1e-2, foreach=False)


def adamw_foreach(params):
    return torch.optim.AdamW(params, lr=1e-2, foreach=True)


def sgd_foreach(params):
    return torch.optim.SGD(params, lr=0.05, foreach=True)


OPTIMIZERS = [sgd_momentum, adamw_for_loop, adamw_foreach, sgd_foreach]


def _optimizers(model, batches, refs) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for make_opt, ref in zip(OPTIMIZERS, refs):
        for strategy in STRATEGIES:
            m = shard(copy.deepcopy(model), True, sharding_strategy=strategy)
            train(m, batches, rank=rank, world=world, make_opt=make_opt)
            out[(make_opt.__name__, strategy)] = max_diff(full_state(m), ref)
    return out


def test_plain_torch_optimizers_work_unchanged() -> None:
    model, batches = make_model(), make_batches(3)
    refs = [reference(model, batches, make_opt=make_opt) for make_opt in OPTIMIZERS]
    result = run_ranks(_optimizers, 2, model, batches, refs, backend="gloo")[0]
    bad = {k: v for k, v in result.items() if not v <= 1e-5}
    assert not bad, bad


def _state_dict_round_trip(model, batches) -> bool:
    rank, world = dist.get_rank(), dist.get_world_size()
    from tests.fsdp.models import loss_fn

    trained = shard(copy.deepcopy(model), True)
    train(trained, batches, rank=rank, world=world)
    fresh = shard(copy.deepcopy(model), True)
    x, y = batches[0]
    loss_fn(fresh, x, y)  # gathers the untrained weights once
    fresh.load_state_dict(trained.state_dict())  # in-place copies: the next forward refreshes
    with torch.no_grad():
        return torch.equal(loss_fn(fresh, x, y), loss_fn(trained, x, y))


def test_load_state_dict_refreshes_model_weights() -> None:
    model, batches = make_model(), make_batches(2)
    assert all(run_ranks(_state_dict_round_trip, 2, model, batches, backend="gloo"))


# ----------------------------------------------------------------------------- persistent_param_shard


def _lean_vs_persistent(model, batches) -> dict:
    """Train with ``persistent_param_shard`` True (default) and False, torch.optim and
    fsdp.FlatAdamW, in the default layout (every gather casts the main weights straight into its
    own row, FSDP2's copy-in: no model shard is kept with either setting) and with ``Owned``
    buckets (a gather reads a model shard: kept between steps by default, cast before each
    gather when lean). A model shard holds storage only where it is kept: never from forward to
    backward, nor in a unit whose weights stay gathered until the step."""
    from dbuffer import Owned

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for owned in (False, True):
        buckets = dict(buckets=[fsdp.Bucket("*", placement=Owned())]) if owned else {}
        for strategy in ("optim", "optim_grads_params") if owned else ("no_shard", "optim", "optim_grads_params"):
            for flat in (False, True):
                states = []
                for persistent in (True, False):
                    policy = fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, persistent_param_shard=persistent)
                    m = shard(copy.deepcopy(model), True, sharding_strategy=strategy, mp_policy=policy, **buckets)
                    make = (lambda ps: fsdp.FlatAdamW(ps, lr=1e-2, weight_decay=0.1)) if flat else None
                    at_forward_end: list[bool] = []  # after fsdp's root post-forward: every shard gone
                    m.register_forward_hook(lambda mod, args, out: at_forward_end.append(
                        all(g.weights.model.is_storage_released() for u in mod._fsdp_state.units for g in u.groups)))
                    train(m, batches, rank=rank, world=world, make_opt=make)
                    case = (owned, strategy, persistent, flat)
                    assert at_forward_end == [strategy != "no_shard"] * len(batches), case
                    groups = [g for u in m._fsdp_state.units for g in u.groups]
                    sharded = strategy != "no_shard"
                    assert [g.weights.casts_into_gather for g in groups] == [sharded and not owned] * len(groups), case
                    for g in groups:  # the row cast into is made once and stays a view of the gather's target
                        if g.weights.casts_into_gather:
                            target, row = g.weights._row_of
                            assert target is g.weights.gathered_buffer(), case
                            assert row.local_buffer._base is target.local_buffer, case
                    lean = [g.weights.lean_model for g in groups]
                    assert lean == [sharded and not (owned and persistent)] * len(groups), case
                    # Between steps a kept shard holds storage only where a gather still reads it:
                    # the blocks' ZeRO-3 backward. The root keeps its gathered weights from forward
                    # to the end of backward, ZeRO-1/2 until the next step: theirs went after the gather.
                    for u in m._fsdp_state.units:
                        gathered_until_step = strategy == "optim" or u is m._fsdp_state
                        for g in u.groups:
                            expected = g.weights.lean_model or (gathered_until_step and sharded)
                            assert g.weights.model.is_storage_released() == expected, case
                    states.append(full_state(m))
                out[(owned, strategy, flat)] = max_diff(*states)
    return out


def test_lean_param_shard_trains_the_same_weights() -> None:
    """The lean mode casts the same main weights into the same BF16 values, only later: every
    strategy trains bit for bit the same weights as with the persistent shard."""
    table = run_ranks(_lean_vs_persistent, 2, make_model(), make_batches(3), backend="gloo")[0]
    assert all(v == 0.0 for v in table.values()), table


def test_persistent_param_shard_must_be_bool() -> None:
    with pytest.raises(TypeError, match="persistent_param_shard must be a bool"):
        fsdp.MixedPrecisionPolicy(persistent_param_shard="lean")


# ----------------------------------------------------------------------------- main-grad lifetime


class _AdamWZeroing(torch.optim.AdamW):
    """AdamW whose ``zero_grad()`` (what ``train`` calls) uses a fixed ``set_to_none``."""

    def __init__(self, params, set_to_none: bool) -> None:
        super().__init__(params, lr=1e-2, weight_decay=0.1)
        self.set_to_none = set_to_none

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=self.set_to_none)


def _main_grad_lifetime(model, batches) -> dict:
    """At the root's forward (fsdp's pre-hook has run, no block has), after each step's
    ``zero_grad``: with set_to_none every unit's main-grad storage is already freed; with
    set_to_none=False it is kept (zeroed), and the next backward accumulates into it, as FSDP2's
    gradients do."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for set_to_none in (True, False):
        m = shard(copy.deepcopy(model), True)
        groups = [g for mod in m.modules() if isinstance(mod, fsdp.FSDPModule)
                  for g in mod._fsdp_state.groups if g.requires_grad]
        released: list[list[bool]] = []
        m.register_forward_pre_hook(
            lambda mod, args: released.append([g.grads.main_grad.is_storage_released() for g in groups])
        )
        train(m, batches, rank=rank, world=world, make_opt=lambda ps, s=set_to_none: _AdamWZeroing(ps, s))
        out[set_to_none] = (len(groups), released, full_state(m))
    return out


def test_main_grads_are_freed_before_the_next_forward_after_zero_grad_set_to_none() -> None:
    model, batches = make_model(), make_batches(3)
    ref = reference(model, batches)
    for out in run_ranks(_main_grad_lifetime, 2, model, batches, backend="threaded"):
        (n, freed, state_none), (_, kept, state_zero) = out[True], out[False]
        assert n == len(model.blocks) + 1
        assert freed == [[True] * n] * 3  # the first step has none yet; later ones were dropped
        assert kept == [[True] * n] + [[False] * n] * 2  # zeroed, kept for accumulation
        assert max_diff(state_none, state_zero) == 0.0  # 0 + g == g: the same training bit for bit
        assert max_diff(state_none, ref) <= 1e-5
