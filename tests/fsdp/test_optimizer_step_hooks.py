"""fsdp.optimizer_step_hooks: the global torch.optim hooks are installed by ``import fsdp`` and can
be turned off and on again. With them, a torch.optim step is visible to the next forward; without
them the compute weights stay stale until ``group.unsharder.mark_stale()`` (what the hooks call)."""

from __future__ import annotations

import copy

import torch
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

import fsdp
from tests.fsdp.models import loss_fn, make_batches, make_model
from tests.fsdp.test_parity import shard
from tests.harness import run_ranks


def _stale_without_hooks(model, batch) -> dict:
    x, y = batch
    out = {}
    for hooks in (True, False):
        was = fsdp.optimizer_step_hooks(hooks)
        try:
            # optim_grads keeps gathered weights between steps: only a refresh updates them
            m = shard(copy.deepcopy(model), True, sharding_strategy="optim_grads")
            opt = torch.optim.SGD(m.parameters(), lr=0.5, foreach=True)
            before = float(loss_fn(m, x, y).detach())
            loss_fn(m, x, y).backward()
            groups = [g for unit in [m._fsdp_state] + [b._fsdp_state for b in m.blocks] for g in unit.groups]
            opt.step()
            current = [all(g.unsharder.is_current() for g in groups)]  # the query: what a refresh would find
            after = float(loss_fn(m, x, y).detach())
            current.append(all(g.unsharder.is_current() for g in groups))
            for group in groups:
                group.unsharder.mark_stale()
            current.append(any(g.unsharder.is_current() for g in groups))
            marked = float(loss_fn(m, x, y).detach())
            current.append(all(g.unsharder.is_current() for g in groups))
            out[hooks] = (before, after, marked, current)
        finally:
            fsdp.optimizer_step_hooks(was)
    return out


def test_hooks_refresh_after_a_step_and_can_be_turned_off() -> None:
    model, batch = make_model(), make_batches(1)[0]
    on, off = run_ranks(_stale_without_hooks, 2, model, batch, backend="gloo")[0].values()
    assert on[1] != on[0] and on[2] == on[1]  # the step is seen at once
    assert off[1] == off[0]  # stale: the step is not seen ...
    assert off[2] == on[1]  # ... until mark_stale(), which then gives what the hooks give
    # Unsharder.is_current(): False from the hooks' mark until the next forward refreshes;
    # without hooks True (nothing marked the groups) until mark_stale()
    assert on[3] == [False, True, False, True] and off[3] == [True, True, False, True]


def test_installing_is_idempotent_and_reversible() -> None:
    def count() -> int:
        return len(_global_optimizer_pre_hooks) + len(_global_optimizer_post_hooks)

    assert fsdp.optimizer_step_hooks(True) is True  # import fsdp installed them
    installed = count()
    assert fsdp.optimizer_step_hooks(True) is True and count() == installed
    assert fsdp.optimizer_step_hooks(False) is True and count() == installed - 2
    assert fsdp.optimizer_step_hooks(False) is False and count() == installed - 2
    assert fsdp.optimizer_step_hooks(True) is False and count() == installed
    try:
        fsdp.optimizer_step_hooks("yes")  # type: ignore[arg-type]
    except TypeError as e:
        assert "True or False" in str(e)
    else:
        raise AssertionError("a non-bool must raise")
