"""``without_grad``: :func:`torch.no_grad` for the methods a training step runs per unit.

A group's gathers, copies and reductions run many times a step, mostly inside autograd's hooks
where grad mode is already off. ``@torch.no_grad()`` builds and enters a context object at every
call either way; this decorator only reads the grad mode, and switches it (back in a ``finally``)
when it is on. Same contract, a fraction of the host time: what a GPU step cannot hide.
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
    """Run ``fn`` with grad mode off, as ``@torch.no_grad()`` does (restored on return and on
    raise); a plain call when it is already off."""

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
