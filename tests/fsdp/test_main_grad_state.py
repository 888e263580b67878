"""``main_grad``'s states (fsdp/group/main_grad_state.py): the table, and the states a real step
walks through, each checked against what the buffer and ``.grad`` actually are, with gradients
compared to one process on the global batch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import fsdp
from fsdp.group.main_grad_state import ALLOWED, MainGrad, MainGradStateError, check_move
from tests.fsdp.models import loss_fn, make_batches, make_model
from tests.fsdp.test_parity import shard
from tests.harness import run_ranks

M = MainGrad


def test_the_table_and_the_moves_its_methods_make() -> None:
    refused = {(a, b) for a in M for b in M if b not in ALLOWED[a]}
    assert refused == {
        (M.EMPTY, M.ATTACHED),  # nothing to attach before a reduction wrote it
        (M.EMPTY, M.ZEROED),
        (M.FILLED, M.ZEROED),  # zeroing keeps views: FILLED has none
        (M.ATTACHED, M.FILLED),  # attached views are not forgotten except by dropping everything
        (M.ZEROED, M.FILLED),
    }
    for a in M:
        assert a.after_reduction().holds_gradients and a.after_reduction() in ALLOWED[a]
        assert not a.without_values().holds_gradients and a.without_values() in ALLOWED[a]
        assert a.without_values().attached == a.attached == a.after_reduction().attached
        assert M.EMPTY in ALLOWED[a]
    for a, b in refused:
        with pytest.raises(MainGradStateError, match=f"\\['w'\\] cannot go from {a.name} to {b.name}"):
            check_move("['w']", a, b)


def _walk(model, batches) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    m = shard(copy.deepcopy(model), True)
    groups = [g for mod in m.modules() if isinstance(mod, fsdp.FSDPModule)
              for g in mod._fsdp_state.groups if g.requires_grad]

    def seen() -> set:
        states = {g.grads.state for g in groups}
        for g in groups:  # each state's claim about .grad and the buffer, checked on the real thing
            views = [p.grad is not None and p.grad.to_local().untyped_storage().data_ptr()
                     == g.grads.main_grad.local_buffer.untyped_storage().data_ptr() for p in g.sharded_params]
            assert all(views) if g.grads.state.attached else not any(views), (g.grads.state, views)
            if g.grads.state is M.ZEROED:
                assert float(g.grads.main_grad.local_buffer.abs().max()) == 0
        return states

    def backward(x, y) -> None:
        per = x.shape[0] // world
        loss_fn(m, x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]).backward()

    (x0, y0), (x1, y1) = batches
    out = {"start": seen()}
    backward(x0, y0)
    out["after backward"] = seen()
    out["grads"] = {n: p.grad.full_tensor() for n, p in m.named_parameters()}
    m.zero_grad_buffer()
    out["after zero_grad_buffer"] = seen()
    backward(x1, y1)  # overwrites the zeroed buffer through the attached views
    out["after the next backward"] = seen()
    out["grads again"] = {n: p.grad.full_tensor() for n, p in m.named_parameters()}
    m.zero_grad(set_to_none=True)
    m(x0[:1])  # the next forward notices every .grad dropped
    out["after zero_grad and a forward"] = seen()
    return out


def test_a_step_walks_the_states_and_each_holds() -> None:
    model, batches = make_model(), make_batches(2)
    refs = []
    for x, y in batches:
        ref = copy.deepcopy(model)
        loss_fn(ref, x, y).backward()
        refs.append({n: p.grad for n, p in ref.named_parameters()})
    for out in run_ranks(_walk, 2, model, batches, backend="threaded"):
        assert out["start"] == {M.EMPTY}
        assert out["after backward"] == {M.ATTACHED}
        assert out["after zero_grad_buffer"] == {M.ZEROED}
        assert out["after the next backward"] == {M.ATTACHED}
        assert out["after zero_grad and a forward"] == {M.EMPTY}
        for got, ref in ((out["grads"], refs[0]), (out["grads again"], refs[1])):
            assert max(float((got[n] - ref[n]).abs().max()) for n in ref) <= 1e-5
