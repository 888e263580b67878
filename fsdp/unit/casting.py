"""The mixed-precision policy's casts of a unit's forward inputs (``param_dtype``, with
``cast_forward_inputs``) and outputs (``output_dtype``), as FSDP2 applies them. Flat inputs, the
usual case, are cast one by one, or returned as they are: a pytree map at every unit's forward
would cost more than the rest of its forward hook.
"""

from __future__ import annotations

from typing import TypeGuard, TypeVar

import torch
from torch.utils._pytree import tree_map

__all__ = ["cast_floats", "cast_inputs"]

_LEAVES = (torch.Tensor, int, float, bool, str, type(None))
T = TypeVar("T")


def cast_floats(tree: T, dtype: torch.dtype) -> T:
    """``tree`` with every floating-point tensor in ``dtype`` (others, and containers, as they are)."""
    return tree_map(lambda x: _cast(x, dtype), tree)


def cast_inputs(args: tuple, kwargs: dict, dtype: torch.dtype) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with their floating-point tensors in ``dtype``, without a tree walk
    when flat (tensors and scalars); the same objects when nothing needed a cast."""
    values = (*args, *kwargs.values())
    if not all(isinstance(x, _LEAVES) for x in values):  # a container, or a type pytree may know
        return cast_floats((args, kwargs), dtype)
    if not any(_needs_cast(x, dtype) for x in values):
        return args, kwargs
    return tuple(_cast(x, dtype) for x in args), {k: _cast(v, dtype) for k, v in kwargs.items()}


def _needs_cast(x: object, dtype: torch.dtype) -> TypeGuard[torch.Tensor]:
    return isinstance(x, torch.Tensor) and x.dtype != dtype and x.is_floating_point()


def _cast(x: object, dtype: torch.dtype) -> object:
    return x.to(dtype) if _needs_cast(x, dtype) else x
