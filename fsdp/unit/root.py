"""RootContext: what only a root unit holds, for the whole tree of units below it.

The first unit to run forward becomes the root of every unit below it (``FSDPState._lazy_init``),
and some things exist once per tree, not once per unit (FSDP2 keeps them in the root's
``FSDPStateContext`` and ``FSDPCommContext``): the tree's units, the order they ran forward in
(prefetching follows it), the gradient reductions in flight and their bound, the end-of-backward
callback (queued once per backward), whether that end waits for the reductions
(``set_is_last_backward``), the post-optimizer event, and the comm streams (one set per device,
shared by every unit on it: :mod:`fsdp.group.streams`). A unit below a root holds none of it:
its ``root_ctx`` is None and its hooks report to ``state.root.root_ctx``.

How a backward iteration ends (torch 2.15's manual backward finalization) is the tree's too: with
``set_manual_backward_finalization(True)`` the end-of-backward callback leaves every unit's
reductions and reshards for ``finalize_backward()``, which a pipeline schedule calls once after
all the micro-batches of a step; :class:`Finalization` is where the iteration stands, and its
moves are checked.

Knobs that only a root reads (``set_is_last_backward``, ``set_post_optim_event``,
``set_reduce_scatter_max_input_buffers``, ``set_manual_backward_finalization``) may be set before the first forward, when no unit
knows yet whether it is a root: they create the unit's context then. Lazy initialisation keeps
the root's and drops those of units below it: as in FSDP2, such a knob has an effect only on the
root. A unit not yet initialised whose gradients arrive anyway (parameters used after
``unshard()`` outside any forward) acts as the root of itself.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Protocol

from fsdp.group.grads import GradReducer
from fsdp.group.streams import CommStreams, DeviceEvent

if TYPE_CHECKING:
    import torch.nn as nn
    from typing_extensions import Self

    from fsdp.group.param_group import ParameterGroup
    from fsdp.unit.training_state import TrainingState

__all__ = ["Finalization", "MAX_REDUCTIONS_IN_FLIGHT", "RootContext", "Unit"]

# One reduction in flight while the next unit computes its gradients: a unit's backward takes far
# longer than reducing its shard, so a second one in flight buys no overlap and costs a whole
# unsharded gradient buffer at the step's memory peak (tools/mem_timeline.py shows where).
MAX_REDUCTIONS_IN_FLIGHT = 1


class Finalization(enum.Enum):
    """Where the tree's backward iteration stands under manual finalization."""

    OPEN = "open"  # no backward waits for finalize_backward()
    BACKWARD = "backward"  # a backward ended under manual finalization: finalize_backward() ends the iteration
    REDUCING = "reducing"  # finalize_backward(async_op=True) returned: the handle's wait() ends it


#: ``_FINALIZATION_MOVES[current]``: the states the iteration may enter from ``current``.
_FINALIZATION_MOVES = {
    Finalization.OPEN: {Finalization.OPEN, Finalization.BACKWARD, Finalization.REDUCING},
    Finalization.BACKWARD: {Finalization.BACKWARD, Finalization.OPEN, Finalization.REDUCING},
    Finalization.REDUCING: {Finalization.OPEN},
}


class Unit(Protocol):
    """A unit as the tree's code reads it (here, :mod:`~fsdp.unit.lazy_init`,
    :mod:`~fsdp.unit.finalization`, :mod:`~fsdp.unit.read_watch`, :mod:`~fsdp.unit.pipelining`):
    an :class:`~fsdp.unit.state.FSDPState`, named by this Protocol because that module imports
    these ones."""

    modules: list[nn.Module]
    groups: list[ParameterGroup]
    root: Optional[Self]  # the tree's root, set by lazy initialisation
    root_ctx: Optional[RootContext]  # roots only
    fqn: Optional[str]
    training_state: TrainingState
    requires_grad_sync: bool
    reshard_after_backward: bool
    registered_unsharded: bool
    shared_with_other_units: list[str]
    read_after_forward: list[str]

    def name(self) -> str:
        """The unit's name, for messages."""

    def _enter(self, target: TrainingState) -> None:
        """Move to ``target``, checked."""

    def unshard(self, async_op: bool = False) -> None:
        """Gather the unit's weights (``async_op``: leave the gathers in flight)."""

    def register_unsharded_params(self) -> None:
        """Register the gathered parameters on the modules."""

    def reshard(self) -> None:
        """Free the unsharded weights and register the sharded parameters again."""

    def settle_after_backward(self) -> None:
        """The end of the unit's backward: reshard, or keep the gathered weights (``reshard_after_backward``)."""

    def _final_callback(self) -> None:
        """The root's end of backward."""


@dataclass(eq=False)
class RootContext:
    """The tree's shared state, held by its root (see the module docstring)."""

    units: list[Unit]  # every unit of the tree, the root first (named_modules order)
    forward_order: list[Unit] = field(default_factory=list)  # units in the order their forward began
    post_forward_order: list[Unit] = field(default_factory=list)  # ... and in the order it ended
    # The order is complete (prefetching may follow it) from the root's second grad-enabled
    # forward on: the first one, or a no_grad one before it, records it.
    order_complete: bool = False
    reductions_in_flight: list[GradReducer] = field(default_factory=list)  # oldest first
    max_reductions_in_flight: int = MAX_REDUCTIONS_IN_FLIGHT
    post_optim_event: Optional[DeviceEvent] = None  # waited for before the next gathers, then dropped
    final_callback_queued: bool = False  # once per backward, on the autograd engine
    is_last_backward: bool = True  # False: the end of backward leaves reductions in flight
    streams: list[CommStreams] = field(default_factory=list)  # one per device of the tree's groups
    manual_finalization: bool = False  # set_manual_backward_finalization: finalize_backward() ends a backward
    finalization: Finalization = Finalization.OPEN

    def finalize_move(self, target: Finalization, what: str) -> None:
        """Move the backward iteration to ``target``, or raise ``RuntimeError`` (FSDP2's words)
        saying what must come first; ``what`` names the caller's action."""
        if target not in _FINALIZATION_MOVES[self.finalization]:
            raise RuntimeError(f"The previous gradient reduction must be waited on before {what}")
        self.finalization = target

    def take_tree(self, units: list[Unit]) -> None:
        """The tree found by lazy initialisation: its units and the streams their groups use."""
        self.units = units
        streams = {id(g.streams): g.streams for unit in units for g in unit.groups}
        self.streams = list(streams.values())

    # ------------------------------------------------------------------ forward order

    def root_forward_begins(self, grad_enabled: bool) -> bool:
        """The root's forward begins; True if the forward order has just become complete."""
        was = self.order_complete
        if grad_enabled:
            self.order_complete = bool(self.forward_order)
        return self.order_complete and not was

    def ran_forward(self, unit: Unit) -> None:
        if not self.order_complete and unit not in self.forward_order:
            self.forward_order.append(unit)

    def finished_forward(self, unit: Unit) -> None:
        if not self.order_complete and unit not in self.post_forward_order:
            self.post_forward_order.append(unit)

    def neighbour(self, unit: Unit, step: int) -> list[Unit]:
        """The unit to prefetch after ``unit``, once the order is complete (none before): in
        forward (``step`` +1) the next in the order forwards began; in backward (-1) the next in
        the *reverse* order forwards ended, as FSDP2 does. The backward order matters when a unit
        ends its forward after the ones it calls (a root holding the head): it comes first in
        backward, and once its gradients are reduced no unit gathers it again."""
        if not self.order_complete:
            return []
        order = self.forward_order if step > 0 else self.post_forward_order[::-1]
        if unit not in order:
            return []
        k = order.index(unit) + 1
        return [order[k]] if k < len(order) else []

    # ------------------------------------------------------------------ reductions

    def launched(self, grads: GradReducer) -> None:
        """A group's reducer launched its reduction. Finishing the oldest ones beyond the bound
        frees their unsharded gradient buffers during backward, instead of all of them living to
        its end."""
        self.reductions_in_flight.append(grads)
        self.finish_reductions(keep=self.max_reductions_in_flight)

    def finish_reductions(self, keep: int = 0) -> None:
        """Finish the oldest reductions in flight until at most ``keep`` remain."""
        while len(self.reductions_in_flight) > keep:
            self.reductions_in_flight.pop(0).finish_reduce()

    # ------------------------------------------------------------------ post-optimizer event

    def wait_post_optim_event(self) -> None:
        """The next gathers start after the post-optimizer event, if one was set (used once)."""
        event, self.post_optim_event = self.post_optim_event, None
        if event is None:
            return
        if not self.streams:  # no group to gather: the host waits, as without real streams
            event.synchronize()
        for streams in self.streams:
            streams.gathers_wait(event)
