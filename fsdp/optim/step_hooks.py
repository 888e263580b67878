"""torch.optim step hooks that keep fsdp's weights right whatever optimizer the user builds.

:func:`optimizer_step_hooks` describes them; they also move offloaded state
(:mod:`fsdp.optim.offloaded`). ``import fsdp`` installs them by intent, not as an import side
effect.
"""

from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from fsdp.group.registration import registrations
from fsdp.optim.offloaded import PLANS, TorchStateOffload

__all__ = ["optimizer_step_hooks"]


def _after_optimizer_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """Send offloaded state back to the host, then mark stale the groups whose parameters the
    optimizer updated (state made like them already has their rows: :mod:`dbuffer.row_sharded`)."""
    plan = PLANS.get(optimizer)
    if plan is not None:
        plan.after_step(optimizer)
    groups = {}
    for param_group in optimizer.param_groups:
        for p in param_group["params"]:
            ref = getattr(p, "_fsdp_group", None)
            group = ref() if ref is not None else None
            if group is not None:
                groups[id(group)] = group
    for group in groups.values():  # once per group, however many of its parameters it holds
        group.unsharder.mark_stale()


# Per optimizer, the (registrations, param-group sizes) it was checked at.
_CHECKED: "weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple]" = weakref.WeakKeyDictionary()


def _before_optimizer_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """Refuse an optimizer holding parameters fsdp does not train (its steps would change nothing):
    checked once per optimizer, again when its param-group sizes or fsdp's registrations change."""
    key = (registrations(), tuple(len(g["params"]) for g in optimizer.param_groups))
    if _CHECKED.get(optimizer) != key:
        _check(optimizer)
        plan = PLANS.get(optimizer)
        if plan is not None:
            plan.restore(optimizer)
        PLANS[optimizer] = TorchStateOffload.of(optimizer)
        _CHECKED[optimizer] = key
    plan = PLANS.get(optimizer)
    if plan is not None:  # offloaded state: to where the step runs
        plan.before_step(optimizer, args, kwargs)


def _check(optimizer: torch.optim.Optimizer) -> None:
    for i, param_group in enumerate(optimizer.param_groups):
        for p in param_group["params"]:
            if getattr(p, "_fsdp_unsharded", False):
                raise RuntimeError(
                    f"{type(optimizer).__name__}: param_groups[{i}] holds an unsharded (gathered) view of "
                    f"a parameter of shape {tuple(p.shape)}, registered between a unit's forward and the "
                    f"end of its backward; fsdp overwrites it at the next gather, so steps on it are lost. "
                    f"Build the optimizer from model.parameters() while the model is resharded (call "
                    f"model.reshard() first, or build it right after fully_shard)"
                )
            if hasattr(p, "_fsdp_owner") and not hasattr(p, "_fsdp_group"):
                raise RuntimeError(
                    f"{type(optimizer).__name__}: param_groups[{i}] holds a parameter of shape "
                    f"{tuple(p.shape)} that fully_shard replaced ({getattr(p, '_fsdp_owner')} holds it "
                    f"as a sharded DTensor now), so its steps would change nothing the model uses. "
                    f"Build the optimizer after fully_shard, from model.parameters()"
                )


_HANDLES: list = []  # the installed hooks' removable handles; empty: not installed


def optimizer_step_hooks(enabled: bool = True) -> bool:
    """Install (``enabled=True``) or remove (``enabled=False``) fsdp's global ``torch.optim`` step
    hooks; ``import fsdp`` installs them. Idempotent and process-wide; returns whether they were
    installed before the call. Raises ``TypeError`` for a non-bool.

    While installed: after any optimizer's step, the groups it updated refresh their compute weights
    before the next gather; before its first step (and after fsdp registers new parameters) an
    optimizer holding parameters fsdp replaced or unsharded views raises ``RuntimeError`` naming the
    fix. Without them, call ``group.unsharder.mark_stale()`` on the groups you update
    (:class:`fsdp.FlatOptimizer` does); offloaded state stays where torch puts it."""
    if not isinstance(enabled, bool):
        raise TypeError(f"optimizer_step_hooks(enabled): pass True or False, got {enabled!r}")
    was = bool(_HANDLES)
    if enabled and not was:
        _HANDLES.append(register_optimizer_step_pre_hook(_before_optimizer_step))
        _HANDLES.append(register_optimizer_step_post_hook(_after_optimizer_step))
    elif not enabled:
        while _HANDLES:
            _HANDLES.pop().remove()
    return was
