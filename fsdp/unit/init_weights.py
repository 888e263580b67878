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
    """Initialise the sharded weights of every unit below ``module``, holding in full only the
    units being initialised (e.g. after building under ``torch.device("meta")``).

    Calls ``init_fn(m)`` (default: ``m.reset_parameters()`` where defined, on modules with their
    own parameters or buffers) on each of ``module.modules()`` in order, keeping an eager build's
    random stream: same seed, same weights. Meanwhile a unit's parameters are full tensors in the
    main dtype; after its last module each rank keeps its rows. Every rank must call it. Whatever
    ``init_fn`` raises propagates, the units being initialised keeping their sharded values.
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
