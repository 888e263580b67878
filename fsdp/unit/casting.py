"""The mixed-precision policy's casts of a unit's forward inputs (``param_dtype``, with
``cast_forward_inputs``) and outputs (``output_dtype``), as FSDP2 applies them.

Every unit casts its inputs at every forward. The usual block call passes a few tensors already
in the compute dtype, and a pytree map over them would cost more than the rest of the unit's
forward hook: flat inputs are cast one by one, and returned as they are when nothing needs it.
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
    """A forward's ``args`` and ``kwargs`` with their floating-point tensors in ``dtype``: cast
    in place of a tree walk when they are flat (tensors and scalars), the same objects when
    nothing needed a cast."""
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
