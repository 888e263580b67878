"""``without_grad``: :func:`torch.no_grad` for the methods a training step runs per unit, many
times a step and mostly in autograd's hooks where grad mode is already off: ``@torch.no_grad()``
enters a context object at every call anyway, this only reads the mode.
"""

from __future__ import annotations

import functools
from typing import Callable, TypeVar

import torch

__all__ = ["without_grad"]

F = TypeVar("F", bound=Callable)

_is_enabled = torch.is_grad_enabled
_set_enabled = torch._C._set_grad_enabled


def without_grad(fn: F) -> F:
    """Run ``fn`` with grad mode off (restored on return and raise); a plain call if already off."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not _is_enabled():
            return fn(*args, **kwargs)
        _set_enabled(False)
        try:
            return fn(*args, **kwargs)
        finally:
            _set_enabled(True)

    return run  # type: ignore[return-value]
