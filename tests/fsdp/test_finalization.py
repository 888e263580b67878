"""torch 2.15's manual backward finalization and kept unsharded storage, on fsdp (any torch).

* ``set_manual_backward_finalization(True)`` + ``finalize_backward()``: micro-batches accumulated
  without sync, then one finalization (synchronous, or asynchronous with a
  ``GradientReductionHandle``), train like one process on the global batch and like torch
  FSDP2 where the installed torch has the methods; reductions launched during backward (sync
  on) are finished by the finalization too.
* Misuse raises FSDP2's ``RuntimeError`` s: finalizing without the mode, on a unit below the
  root, twice before waiting; a forward before the handle is waited for; the mode set on a
  unit below the root; a handle invalidated by ``reset_iter_state``.
* ``set_keep_unsharded_storage(True)``: the unsharded parameters keep their data pointers
  across reshard and unshard (and training is unchanged); by default the storage is freed.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp

import fsdp
from tests.fsdp.models import full_state, loss_fn, make_batches, make_model, max_diff, reference, train
from tests.fsdp.test_parity import shard
from tests.harness import run_ranks


def _local(x, y, rank, world):
    per = x.shape[0] // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def _manual_steps(m, batches, sync_in_backward: bool, async_op: bool) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    m.set_manual_backward_finalization(True)
    for x, y in batches:
        x, y = _local(x, y, rank, world)
        m.set_requires_gradient_sync(sync_in_backward)
        for xm, ym in zip(x.chunk(2), y.chunk(2)):
            (loss_fn(m, xm, ym) / 2).backward()
        m.set_requires_gradient_sync(True)
        handle = m.finalize_backward(async_op=async_op)
        if async_op:
            with pytest.raises(RuntimeError, match="must be waited on before forward"):
                m(x)
            handle.wait()
            handle.wait()  # idempotent
        else:
            assert handle is None
        opt.step()
        opt.zero_grad()


def _finalized(model, batches) -> dict:
    out = {}
    for sync in (False, True):
        for async_op in (False, True):
            m = shard(copy.deepcopy(model), True)
            _manual_steps(m, batches, sync, async_op)
            out[(sync, async_op)] = full_state(m)
    if hasattr(torch_fsdp.FSDPModule, "finalize_backward"):  # torch 2.15 and later: FSDP2 in the same run
        m = copy.deepcopy(model)
        for block in m.blocks:
            torch_fsdp.fully_shard(block)
        torch_fsdp.fully_shard(m)
        _manual_steps(m, batches, False, True)
        out["fsdp2"] = full_state(m)
    return out


def test_manual_finalization_trains_like_one_process() -> None:
    model, batches = make_model(), make_batches(3)
    ref = reference(model, batches, micro=2)
    results = run_ranks(_finalized, 2, model, batches, backend="threaded")
    r = results[0]
    fsdp2 = r.pop("fsdp2", None)
    for key, state in r.items():
        assert max_diff(state, ref) <= 1e-5, (key, max_diff(state, ref))
        if fsdp2 is not None:
            assert max_diff(state, fsdp2) <= 1e-6, (key, max_diff(state, fsdp2))


def _misuse(model, batch) -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = _local(*batch, rank, world)
    seen = []

    def expect(fn, match):
        with pytest.raises(RuntimeError, match=match):
            fn()
        seen.append(match)

    m = shard(copy.deepcopy(model), True)
    assert m.finalize_backward() is None  # before the first forward: nothing to finalize
    m.finalize_backward(async_op=True).wait()
    loss_fn(m, x, y).backward()
    expect(m.finalize_backward, "requires manual backward finalization")
    expect(lambda: m.blocks[0].set_manual_backward_finalization(True), "must be called on the root")
    m.set_manual_backward_finalization(True)
    loss_fn(m, x, y).backward()
    expect(lambda: m.set_manual_backward_finalization(False), "cannot change mode after backward starts")
    expect(m.blocks[0].finalize_backward, "must be called on the root")
    handle = m.finalize_backward(async_op=True)
    expect(m.finalize_backward, "must be waited on before finalizing backward again")
    m.reset_iter_state()
    expect(handle.wait, "invalidated")
    loss_fn(m, x, y).backward()  # usable again
    m.finalize_backward()
    assert all(p.grad is not None for p in m.parameters())

    fresh = shard(copy.deepcopy(model), True)
    fresh.blocks[1].set_manual_backward_finalization(True)  # before lazy init: refused at the first forward
    expect(lambda: fresh(x), "must be called on the root")
    return seen


def test_manual_finalization_misuse_raises_fsdp2s_errors() -> None:
    model, batches = make_model(), make_batches(1)
    results = run_ranks(_misuse, 2, model, batches[0], backend="threaded")
    assert results[0] == results[1] == [
        "requires manual backward finalization", "must be called on the root", "cannot change mode after backward starts",
        "must be called on the root", "must be waited on before finalizing backward again", "invalidated",
        "must be called on the root",
    ], results


def _kept_storage(model, batches) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for keep in (False, True):
        m = shard(copy.deepcopy(model), True)
        m.set_keep_unsharded_storage(keep)
        group = m.blocks[0]._fsdp_state.groups[0]
        pointers, freed = set(), []

        def look(module, args, group=group, pointers=pointers):
            pointers.add(group.unsharded_params[0].untyped_storage().data_ptr())

        m.blocks[0].register_forward_pre_hook(look)

        def after_step(model, group=group, freed=freed):
            freed.append(group.unsharded_params[0].untyped_storage().nbytes() == 0)

        train(m, batches, rank=rank, world=world, before_step=after_step)
        out[keep] = (full_state(m), len(pointers), freed)
    return out


def test_kept_unsharded_storage_keeps_its_pointers_and_trains_the_same() -> None:
    model, batches = make_model(), make_batches(3)
    ref = reference(model, batches)
    r = run_ranks(_kept_storage, 2, model, batches, backend="threaded")[0]
    (freed_state, _, freed), (kept_state, pointers, kept) = r[False], r[True]
    assert all(freed) and not any(kept), (freed, kept)  # after backward: freed by default, kept if asked
    assert pointers == 1  # one data pointer over three steps
    assert max_diff(kept_state, ref) <= 1e-5 and max_diff(kept_state, freed_state) == 0
