"""RootContext: what only a root unit holds, for the whole tree of units below it.

The first unit to run forward becomes the root of every unit below it (``FSDPState._lazy_init``),
and some things exist once per tree, not once per unit (FSDP2 keeps them in the root's
``FSDPStateContext`` and ``FSDPCommContext``): the tree's units, the order they ran forward in
(prefetching follows it), the gradient reductions in flight and their bound, the end-of-backward
callback (queued once per backward), whether that end waits for the reductions
(``set_is_last_backward``), the post-optimizer event, and the comm streams (one set per device,
shared by every unit on it: :mod:`fsdp.group.streams`). A unit below a root holds none of it:
its ``root_ctx`` is None and its hooks report to ``state.root.root_ctx``.

How a backward iteration ends is the tree's too (the functions at the end of this module). By
default the root's end-of-backward callback (:func:`end_of_backward`, queued by
:mod:`fsdp.unit.state`) ends each backward: reductions launched, units resharded, gradients
waited for and attached (:func:`finish_grad_sync`). A pipeline schedule runs several backwards
per step (one per micro-batch, some split into an input-gradient and a weight-gradient part) and
wants one end, after all of them, as a step of its own: torch 2.15's
``set_manual_backward_finalization(True)`` and ``finalize_backward(async_op=...)``. Then each
backward's callback only closes the backward (:func:`end_backward`), and
:func:`finalize_backward` does the rest once, leaving the reductions in flight until
:func:`finish_finalized` (a :class:`~fsdp.unit.module.GradientReductionHandle`'s ``wait()`` when
asynchronous); :class:`Finalization` is where the iteration stands, and its moves are checked.
After a forward or backward that raised, :func:`reset_iter_state` returns the tree to the start
of an iteration.

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

from dbuffer.collectives import release_workspaces
from fsdp.group.grads import GradReducer
from fsdp.group.profiling import label
from fsdp.group.streams import CommStreams, DeviceEvent
from fsdp.unit.training_state import TrainingState, in_backward

if TYPE_CHECKING:
    import torch.nn as nn
    from typing_extensions import Self

    from fsdp.group.param_group import ParameterGroup

__all__ = [
    "Finalization", "MAX_REDUCTIONS_IN_FLIGHT", "RootContext", "Unit", "end_backward", "end_of_backward",
    "finalize_backward", "finish_finalized", "finish_grad_sync", "reset_iter_state",
]

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
    :mod:`~fsdp.unit.read_watch`, :mod:`~fsdp.unit.pipelining`):
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


# ---------------------------------------------------------------------------------- the end of a backward iteration


def finish_grad_sync(units: list[Unit], launch: bool) -> None:
    """Wait for every reduction of ``units`` and attach their gradients; with ``launch``, first
    reduce the gradients they still hold locally (all launched before any wait: they overlap)."""
    with label("fsdp::finish_grad_sync"):
        reducers = [g.grads for unit in units for g in unit.groups if g.grads is not None]
        if launch:
            for grads in reducers:
                grads.launch_reduce()
        for grads in reducers:
            grads.finish_reduce()
            grads.attach_grads()


def end_of_backward(ctx: RootContext) -> None:
    """The root's callback at the end of a backward (queued once per backward on the autograd
    engine): every unit IDLE, the gradients still held reduced (units that sync), every unit
    resharded and, on the last backward, every reduction waited for and ``.grad`` attached.
    Under manual finalization only :func:`end_backward`."""
    with label("fsdp::root_post_backward"):
        ctx.final_callback_queued = False
        if ctx.manual_finalization:
            end_backward(ctx)
            return
        ctx.reductions_in_flight.clear()  # whatever is still in flight is finished below
        for unit in ctx.units:
            unit._enter(TrainingState.IDLE)
            if unit.requires_grad_sync:
                for group in unit.groups:
                    if group.grads is not None and group.grads.has_local_grads():
                        group.grads.launch_reduce()
            # Not the last backward and weights kept: they stay registered too, so a pipeline's
            # weight-gradient step differentiates the parameters its input-gradient step saw
            # (as FSDP2 leaves them).
            if unit.reshard_after_backward or ctx.is_last_backward:
                unit.settle_after_backward()
            for group in unit.groups:
                if group.grads is not None:
                    group.grads.end_backward()
        if ctx.is_last_backward:
            finish_grad_sync(ctx.units, launch=False)
        # Idle collective scratch would otherwise stay through the next forward, the peak of a
        # step; the next backward's first reduction allocates it again.
        release_workspaces()


def reset_iter_state(unit: Unit) -> None:
    """Recover after a forward or backward raised (FSDP2's ``reset_iter_state``): wait for
    gathers, drop every gradient not yet reduced into the main grads (the failed iteration's,
    and those of microbatches accumulated without sync), reshard every unit of ``unit``'s tree
    and return it to IDLE. Only the root may do it: it owns the end of backward."""
    if unit.root is not None and unit.root is not unit:  # never run: nothing to reset but itself
        raise RuntimeError(
            "reset_iter_state must be called on the root FSDP module (the one whose forward ran "
            "first, normally the one fully_shard was applied to last)"
        )
    ctx = unit.root_ctx
    with label("fsdp::reset_iter_state"):
        if ctx is not None:
            ctx.final_callback_queued = False
            ctx.reductions_in_flight.clear()
            ctx.finalization = Finalization.OPEN  # a handle's wait() now raises
        for each in ctx.units if ctx is not None else [unit]:
            for group in each.groups:
                group.unsharder.wait_unshard()
                if group.grads is not None:
                    group.grads.discard_in_flight()
            each.reshard()
            each._enter(TrainingState.IDLE)
        release_workspaces()


def end_backward(ctx: RootContext) -> None:
    """A backward under manual finalization ends: every unit is IDLE and its held gradients are
    packed; launching the reductions of units that sync, resharding, waiting and attaching are
    :func:`finalize_backward`'s. A unit that neither syncs nor keeps its weights
    (``set_reshard_after_backward(True)``) frees them now, as FSDP2's post-backward does; one
    that keeps them also keeps them registered, so a pipeline's weight-gradient step
    (zero-bubble schedules) differentiates the parameters its input-gradient step saw."""
    ctx.finalize_move(Finalization.BACKWARD, "backward")
    for unit in ctx.units:
        unit._enter(TrainingState.IDLE)
        for group in unit.groups:
            if group.grads is not None:
                group.grads.end_backward()
        if not unit.requires_grad_sync and unit.reshard_after_backward:
            unit.reshard()
    release_workspaces()


def finalize_backward(root: Unit) -> None:
    """Close the backward iteration of ``root``'s tree: each unit, the last in forward order
    first, reduces what it holds if it syncs (gradients a pipeline step assigned to the unsharded
    parameters included) and reshards (frees if ``reshard_after_backward``); the reductions stay
    in flight for :func:`finish_finalized`. Raises ``RuntimeError`` (FSDP2's messages), changing
    nothing, on a unit that is not the root, with manual finalization off, inside a backward,
    before the previous asynchronous finalization was waited for, or where an HSDP unit defers
    its all-reduce (``set_requires_all_reduce(False)``)."""
    ctx = root.root_ctx
    if root.root is not root or ctx is None:
        raise RuntimeError("finalize_backward must be called on the root FSDP module")
    if not ctx.manual_finalization and ctx.finalization is Finalization.OPEN:
        raise RuntimeError(
            "FSDP finalize_backward requires manual backward finalization. Call "
            "set_manual_backward_finalization(True) before forward"
        )
    if ctx.final_callback_queued or in_backward():
        raise RuntimeError("FSDP finalize_backward must be called after backward completes")
    if ctx.finalization is Finalization.REDUCING:
        raise RuntimeError("The previous gradient reduction must be waited on before finalizing backward again")
    for unit in ctx.units:
        for group in unit.groups:
            if unit.requires_grad_sync and group.grads is not None and group.grads.defers_all_reduce():
                raise RuntimeError(
                    f"FSDP manual backward finalization requires all-reduce for parameter group "
                    f"{group.names()}. Call set_requires_all_reduce(True) before finalization"
                )
    ctx.finalize_move(Finalization.REDUCING, "finalizing backward again")
    with label("fsdp::finalize_backward"):
        for unit in reversed(ctx.units):
            for group in unit.groups:
                if group.grads is not None:
                    group.grads.take_assigned_grads()
                    if unit.requires_grad_sync:
                        group.grads.launch_reduce()
            unit.settle_after_backward()


def finish_finalized(root: Unit) -> None:
    """Wait for the reductions :func:`finalize_backward` launched and attach ``.grad``: the end
    of the backward iteration. Raises ``RuntimeError`` if ``reset_iter_state`` dropped it."""
    ctx = root.root_ctx
    if ctx is None or ctx.finalization is not Finalization.REDUCING:
        raise RuntimeError("This gradient reduction handle was invalidated")
    ctx.reductions_in_flight.clear()
    finish_grad_sync(ctx.units, launch=False)
    ctx.finalize_move(Finalization.OPEN, "forward")
