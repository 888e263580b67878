"""Callables for autograd's hooks that hold what they call weakly.

A hook registered on fsdp's own parameters lives in autograd's C++ hook table, which the garbage
collector cannot see: a hook holding its gradient reducer (or the unit) strongly would close a
reference cycle through it, and a sharded module would never be freed. These hold their targets
weakly and do nothing once the target is gone.
"""

from __future__ import annotations

import weakref
from typing import Callable, Optional, Protocol

import torch

__all__ = ["GradTarget", "post_accumulate_grad_hook", "weak_callable"]


class GradTarget(Protocol):
    """What a parameter's hook calls: its group's :class:`~fsdp.group.grads.GradReducer`."""

    def _on_grad(self, k: int, p: torch.Tensor) -> None:
        """Autograd accumulated parameter ``k``'s gradient on ``p``."""


def weak_callable(fn: Callable) -> Callable[[], Optional[Callable]]:
    """A weak reference to a bound method; other callables are held strongly."""
    if hasattr(fn, "__self__") and hasattr(fn, "__func__"):
        return weakref.WeakMethod(fn)
    return lambda: fn


def post_accumulate_grad_hook(reducer: GradTarget, k: int) -> Callable[[torch.Tensor], None]:
    """The hook of parameter ``k``: ``reducer._on_grad(k, param)``, while ``reducer`` lives."""
    reducer_ref = weakref.ref(reducer)

    def hook(p: torch.Tensor) -> None:
        target = reducer_ref()
        if target is not None:
            target._on_grad(k, p)

    return hook
