"""The end of a backward iteration: automatic (the root's callback) or manual (``finalize_backward``).

By default the root's end-of-backward callback (:func:`end_of_backward`, queued by
:mod:`fsdp.unit.state`) ends each backward: reductions launched, units resharded, gradients
waited for and attached (:func:`finish_grad_sync`). A pipeline schedule runs several backwards per step (one per
micro-batch, some split into an input-gradient and a weight-gradient part) and wants one end,
after all of them, as a step of its own: torch 2.15's ``set_manual_backward_finalization(True)``
and ``finalize_backward(async_op=...)``. Then each backward's callback only closes the backward
(:func:`end_backward`), and :func:`finalize_backward` does the rest once, leaving the reductions
in flight until :func:`finish_finalized` (a :class:`~fsdp.unit.module.GradientReductionHandle`'s
``wait()`` when asynchronous). Where the iteration stands is the root context's
:class:`~fsdp.unit.root.Finalization`, whose moves are checked. After a forward or backward
that raised, :func:`reset_iter_state` returns the tree to the start of an iteration.
"""

from __future__ import annotations

from dbuffer.collectives import release_workspaces
from fsdp.group.profiling import label
from fsdp.unit.root import Finalization, RootContext, Unit
from fsdp.unit.training_state import TrainingState, in_backward

__all__ = ["end_backward", "end_of_backward", "finalize_backward", "finish_finalized", "finish_grad_sync", "reset_iter_state"]


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
                group.wait_unshard()
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
