"""init_weights: initialise the sharded weights of every unit below a module, one unit at a
time, with the values an unsharded build under the same seed would have."""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn as nn

from fsdp.group.meta_init import begin_init, end_init
from fsdp.unit.module import FSDPModule
from fsdp.unit.state import FSDPState

__all__ = ["init_weights"]


@torch.no_grad()
def init_weights(module: nn.Module, init_fn: Optional[Callable[[nn.Module], None]] = None) -> None:
    """Initialise the sharded weights of every unit below ``module`` without ever holding more
    than the units being initialised (e.g. after building under ``torch.device("meta")``).

    Visits ``module.modules()`` in order and calls ``init_fn(m)`` on each (default:
    ``m.reset_parameters()`` for modules that define it and hold parameters or buffers of their
    own). While a unit's modules are visited its parameters are full plain tensors in the main
    dtype; when its last module is done each rank keeps its own rows and the full copy is freed.
    Visiting in module order keeps the random stream of an eager build: with the same seed the
    weights equal those of the module built on a real device. No communication except the
    ``optim``/``optim_grads`` refresh of the unsharded copy.

    ``module``: a sharded module (units below it are initialised; other modules are visited too);
    ``init_fn``: called as ``init_fn(m)`` per module, in place of ``reset_parameters()``. Whatever
    ``init_fn`` raises propagates, and the units being initialised get their sharded parameters
    back with the values they had (nothing half-initialised is kept). Every rank must call it (the
    same calls and seed on every rank give every rank its rows of the same weights).
    """
    order = list(module.modules())
    owner: dict[int, FSDPState] = {}
    for m in order:
        if isinstance(m, FSDPModule):
            for sub in _own_modules(m._fsdp_state):
                owner.setdefault(id(sub), m._fsdp_state)
    last = {id(owner[id(m)]): i for i, m in enumerate(order) if id(m) in owner}
    for state in {id(s): s for s in owner.values()}.values():
        state.reshard()  # a forward may have left unsharded parameters registered
    active: dict[int, FSDPState] = {}
    fn = init_fn or _reset_parameters
    try:
        for i, m in enumerate(order):
            state = owner.get(id(m))
            if state is not None and id(state) not in active:
                for group in state.groups:
                    begin_init(group)
                active[id(state)] = state
            fn(m)
            if state is not None and last[id(state)] == i:
                del active[id(state)]
                for group in state.groups:
                    end_init(group)
    finally:
        for state in active.values():  # init_fn raised: restore the sharded registration
            for group in state.groups:
                end_init(group, commit=False)


def _reset_parameters(m: nn.Module) -> None:
    if callable(getattr(m, "reset_parameters", None)) and (m._parameters or m._buffers):
        m.reset_parameters()


def _own_modules(state: FSDPState) -> list[nn.Module]:
    """The modules of a unit: its top modules and everything below that no nested unit owns."""
    out, stack = [], list(reversed(state.modules))
    while stack:
        m = stack.pop()
        out.append(m)
        stack.extend(c for c in reversed(list(m.children())) if not isinstance(c, FSDPModule))
    return out


