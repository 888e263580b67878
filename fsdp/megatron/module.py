"""``FsdpModule``: what a module sharded by :func:`fsdp.megatron.fully_shard` gains under
Megatron-FSDP's names, on top of fsdp's own unit.

``fully_shard`` makes the module an fsdp unit (its class becomes ``FSDP<Orig>``, with FSDP2's
methods) and then swaps its class once more to ``MegatronFsdp<Orig>``, a subclass of this mixin
and of that class: ``isinstance(m, fsdp.megatron.FsdpModule)`` and ``isinstance(m,
fsdp.FSDPModule)`` both hold, and fsdp's hooks run the unit. The mixin adds Megatron-FSDP's
attributes, each read from fsdp's state: ``phase`` (:class:`FsdpModule.Phase`, from the unit's
``TrainingState``), ``parameter_groups`` (the unit's :class:`~fsdp.megatron.parameter_group.
FsdpParameterGroup` s), ``context``, ``name``, ``is_root()``.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Optional

import fsdp
from fsdp.megatron.strategy import Deferral, Plan
from fsdp.unit.training_state import TrainingState

if TYPE_CHECKING:
    from fsdp.megatron.context import FsdpContext
    from fsdp.megatron.parameter_group import ParameterGroups

__all__ = ["FsdpModule", "megatron_class"]

_CLASSES: dict[type, type] = {}


class FsdpModule:
    """Mixin of every module :func:`fsdp.megatron.fully_shard` sharded (never built directly):
    ``isinstance(m, FsdpModule)`` tells a Megatron-FSDP unit, which is also an
    :class:`fsdp.FSDPModule` with FSDP2's methods. Its attributes read fsdp's state of the unit
    (see the module docstring); ``name`` raises ``RuntimeError`` before its context is finalised,
    the rest raise nothing."""

    class Phase(enum.Enum):
        """Where a unit is in its step: between its forward hooks, its backward, or neither."""

        RESTING = enum.auto()
        FORWARD = enum.auto()
        BACKWARD = enum.auto()

    _mfsdp_context: "FsdpContext"
    _mfsdp_plan: Plan
    _parameter_groups: "ParameterGroups"
    _name: Optional[str]
    _is_root: bool

    @property
    def context(self) -> "FsdpContext":
        """The :class:`~fsdp.megatron.context.FsdpContext` the unit was built in."""
        return self._mfsdp_context

    @property
    def phase(self) -> "FsdpModule.Phase":
        """``FORWARD`` inside the unit's forward, ``BACKWARD`` from its first output gradient to
        the end of its backward (a recomputed forward included), ``RESTING`` otherwise."""
        state = fsdp.fully_shard.state(self).training_state
        if state is TrainingState.FORWARD:
            return FsdpModule.Phase.FORWARD
        if state is TrainingState.IDLE:
            return FsdpModule.Phase.RESTING
        return FsdpModule.Phase.BACKWARD

    @property
    def parameter_groups(self) -> "ParameterGroups":
        """The unit's parameter groups (a tuple; calling it returns it too, megatron-fsdp 0.6.1's
        spelling)."""
        return self._parameter_groups

    @property
    def name(self) -> str:
        """The unit's name below its root (``""`` for the root), set when its context is
        finalised; ``RuntimeError`` before."""
        if self._name is None:
            raise RuntimeError("FSDP module name has not been initialized: leave its fully_shard_context first")
        return self._name

    def is_root(self) -> bool:
        """Whether no other unit of its context contains it (units sharded outside a
        ``fully_shard_context``: whether fsdp made it the root of a tree at its first forward)."""
        if self._is_root:
            return True
        state = fsdp.fully_shard.state(self)
        return self.context.implicit and state.root is state

    def _apply_microbatch(self, is_last: bool) -> None:
        """Hold back (``is_last=False``) or finish (True) the reductions its plan defers."""
        deferral = self._mfsdp_plan.deferral
        if deferral is Deferral.OUTER:
            self.set_requires_all_reduce(is_last, recurse=False)
        elif deferral is Deferral.ALL:
            self.set_requires_gradient_sync(is_last, recurse=False)


def megatron_class(cls: type) -> type:
    """``MegatronFsdp<Orig>``: this mixin over fsdp's ``FSDP<Orig>`` class ``cls``, one per class."""
    if cls not in _CLASSES:
        name = cls.__name__[4:] if cls.__name__.startswith("FSDP") else cls.__name__
        _CLASSES[cls] = type(f"MegatronFsdp{name}", (FsdpModule, cls), {})
    return _CLASSES[cls]
