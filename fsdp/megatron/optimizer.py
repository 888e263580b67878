"""Megatron-FSDP's ``fully_shard_optimizer``: after each step of the optimizer, every parameter
group it holds syncs its compute weights from its main weights, once.

fsdp already refreshes the groups any ``torch.optim`` step updated (the global step hooks
``import fsdp`` installs); this hook is Megatron-FSDP's explicit one, calling each group's
:meth:`~fsdp.megatron.parameter_group.FsdpParameterGroup.sync_model_weight_from_main_weight`
(looked up on the group each time, so it can be wrapped) once per step, never per
micro-batch. fsdp hands each ``param.grad`` in the parameter's own dtype (a cast copy where the
main grads are narrower: ``param.main_grad`` holds them), so, unlike Megatron-FSDP, nothing is
cast around the step.
"""

from __future__ import annotations

from itertools import chain
from typing import Any

import torch
import torch.nn as nn

from fsdp.megatron.parameter_group import sync_model_weights_from_main_weights

__all__ = ["fully_shard_optimizer"]


def fully_shard_optimizer(optimizer: torch.optim.Optimizer, *, precision_aware: bool = False) -> None:
    """Hook ``optimizer`` (in place, its param groups unchanged) so that each step syncs the
    compute weights of the groups it holds (see the module docstring). ``precision_aware``
    (Megatron-FSDP's: the optimizer takes narrow gradients as they are) changes nothing here,
    since fsdp's ``param.grad`` is in the parameter's dtype already. A step given a closure
    raises ``NotImplementedError`` and a param group holding a tensor that is not an
    ``nn.Parameter`` raises ``TypeError``, both before the step, as in Megatron-FSDP."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"fully_shard_optimizer expects a torch.optim.Optimizer, got {type(optimizer).__name__}")

    def before_step(opt: torch.optim.Optimizer, args: tuple, kwargs: dict[str, Any]) -> None:
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)  # args[0] is the optimizer
        if closure is not None:
            raise NotImplementedError("fully_shard_optimizer does not support optimizer.step closures")
        for group in opt.param_groups:
            for p in group["params"]:
                if not isinstance(p, nn.Parameter):
                    raise TypeError(f"fully_shard_optimizer expected nn.Parameter values in param groups, got {type(p)!r}")

    def after_step(opt: torch.optim.Optimizer, args: tuple, kwargs: dict[str, Any]) -> None:
        sync_model_weights_from_main_weights(chain.from_iterable(g["params"] for g in opt.param_groups))

    optimizer.register_step_pre_hook(before_step)
    optimizer.register_step_post_hook(after_step)
