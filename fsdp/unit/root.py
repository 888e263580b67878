"""RootContext: what only a root unit holds, for the whole tree of units below it.

The first unit to run forward becomes the root of the units below it (``FSDPState._lazy_init``),
holding what exists once per tree, as FSDP2's root contexts do; other units' ``root_ctx`` is None.
Root-only knobs set before then create a unit's context, of which lazy initialisation keeps only
the root's (and the largest reduction bound any asked for); a unit whose gradients arrive before
then acts as its own root. Each backward ends in the root's callback (:func:`end_of_backward`);
under manual finalization a pipeline schedule ends its several backwards once
(:func:`finalize_backward`), in the order :class:`Finalization` checks.
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

# One reduction in flight while the next unit computes its gradients: a unit's backward outlasts
# its reduction, so a second buys no overlap and costs an unsharded gradient buffer at the peak.
MAX_REDUCTIONS_IN_FLIGHT = 1


class Finalization(enum.Enum):
    """Where the tree's backward iteration stands under manual finalization."""

    OPEN = "open"  # no backward waits for finalize_backward()
    BACKWARD = "backward"  # a backward ended: finalize_backward() ends the iteration
    REDUCING = "reducing"  # finalize_backward(async_op=True) returned: the handle's wait() ends it


#: ``_FINALIZATION_MOVES[current]``: the states the iteration may enter from ``current``.
_FINALIZATION_MOVES = {
    Finalization.OPEN: {Finalization.OPEN, Finalization.BACKWARD, Finalization.REDUCING},
    Finalization.BACKWARD: {Finalization.BACKWARD, Finalization.OPEN, Finalization.REDUCING},
    Finalization.REDUCING: {Finalization.OPEN},
}


class Unit(Protocol):
    """An :class:`~fsdp.unit.state.FSDPState`, typed here because that module imports this one."""

    modules: list[nn.Module]
    groups: list[ParameterGroup]
    root: Optional[Self]
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
        """End the unit's backward: reshard, or keep the weights (``reshard_after_backward``)."""

    def _final_callback(self) -> None:
        """The root's end of backward."""


@dataclass(eq=False)
class RootContext:
    """The tree's shared state, held by its root (see the module docstring)."""

    units: list[Unit]  # every unit of the tree, the root first (named_modules order)
    forward_order: list[Unit] = field(default_factory=list)
    post_forward_order: list[Unit] = field(default_factory=list)
    # From the root's second grad-enabled forward (the first, or a no_grad one before, records it).
    order_complete: bool = False
    reductions_in_flight: list[GradReducer] = field(default_factory=list)
    max_reductions_in_flight: int = MAX_REDUCTIONS_IN_FLIGHT
    post_optim_event: Optional[DeviceEvent] = None
    final_callback_queued: bool = False
    is_last_backward: bool = True  # False: the end of backward leaves reductions in flight
    streams: list[CommStreams] = field(default_factory=list)
    manual_finalization: bool = False
    finalization: Finalization = Finalization.OPEN

    def finalize_move(self, target: Finalization, what: str) -> None:
        """Enter ``target``, or raise ``RuntimeError`` (the last reduction is not waited for yet)."""
        if target not in _FINALIZATION_MOVES[self.finalization]:
            raise RuntimeError(f"The previous gradient reduction must be waited on before {what}")
        self.finalization = target

    def take_tree(self, units: list[Unit]) -> None:
        """The tree found by lazy initialisation: its units and the streams their groups use."""
        self.units = units
        streams = {id(g.streams): g.streams for unit in units for g in unit.groups}
        self.streams = list(streams.values())

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
        """The unit to prefetch after ``unit`` once the order is complete: the next to begin forward
        (``step`` +1) or, as FSDP2, the next in *reverse* order of forward ends (-1), since a unit
        ending after the ones it calls (a root holding the head) runs first in backward."""
        if not self.order_complete:
            return []
        order = self.forward_order if step > 0 else self.post_forward_order[::-1]
        if unit not in order:
            return []
        k = order.index(unit) + 1
        return [order[k]] if k < len(order) else []

    def launched(self, grads: GradReducer) -> None:
        """A group's reducer launched its reduction; finishing the oldest beyond the bound frees
        their unsharded gradient buffers during backward, not at its end."""
        self.reductions_in_flight.append(grads)
        self.finish_reductions(keep=self.max_reductions_in_flight)

    def finish_reductions(self, keep: int = 0) -> None:
        """Finish the oldest reductions in flight until at most ``keep`` remain."""
        while len(self.reductions_in_flight) > keep:
            self.reductions_in_flight.pop(0).finish_reduce()

    def wait_post_optim_event(self) -> None:
        """The next gathers start after the post-optimizer event, if one was set (used once)."""
        event, self.post_optim_event = self.post_optim_event, None
        if event is None:
            return
        if not self.streams:  # no group to gather: the host waits, as without real streams
            event.synchronize()
        for streams in self.streams:
            streams.gathers_wait(event)


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
    """The root's callback at a backward's end: units IDLE, held gradients reduced, units resharded
    and, on the last backward, ``.grad`` attached (manual finalization: :func:`end_backward`)."""
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
            # Kept weights stay registered (as FSDP2) for a pipeline's weight-gradient step.
            if unit.reshard_after_backward or ctx.is_last_backward:
                unit.settle_after_backward()
            for group in unit.groups:
                if group.grads is not None:
                    group.grads.end_backward()
        if ctx.is_last_backward:
            finish_grad_sync(ctx.units, launch=False)
        # Free idle collective scratch: it would stay through the next forward, the step's peak.
        release_workspaces()


def reset_iter_state(unit: Unit) -> None:
    """Recover after a forward or backward raised (FSDP2's ``reset_iter_state``): wait for gathers,
    drop unreduced gradients (unsynced microbatches' too), reshard ``unit``'s tree and return it to
    IDLE. Raises ``RuntimeError`` on a non-root: the root owns the end of backward."""
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
    """End a backward under manual finalization: units IDLE, held gradients packed, the rest left to
    :func:`finalize_backward`. A unit that neither syncs nor keeps its weights frees them now."""
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
    """Close ``root``'s backward iteration: each unit, in reverse ``named_modules`` order (the root
    last), reduces what it holds if it syncs (pipeline-assigned gradients too) and settles;
    :func:`finish_finalized` waits. Raises ``RuntimeError`` (FSDP2's), changing nothing, on a
    non-root, with manual finalization off, in a backward, before the previous one was waited
    for, or if HSDP defers an all-reduce."""
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
