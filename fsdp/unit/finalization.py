"""The end of a backward iteration: automatic (the root's callback) or manual (``finalize_backward``).

By default the root's end-of-backward callback (:mod:`fsdp.unit.state`) ends each backward:
reductions launched, units resharded, gradients waited for and attached
(:func:`finish_grad_sync`). A pipeline schedule runs several backwards per step (one per
micro-batch, some split into an input-gradient and a weight-gradient part) and wants one end,
after all of them, as a step of its own: torch 2.15's ``set_manual_backward_finalization(True)``
and ``finalize_backward(async_op=...)``. Then each backward's callback only closes the backward
(:func:`end_backward`), and :func:`finalize_backward` does the rest once, leaving the reductions
in flight until :func:`finish_finalized` (a :class:`~fsdp.unit.module.GradientReductionHandle`'s
``wait()`` when asynchronous). Where the iteration stands is the root context's
:class:`~fsdp.unit.root.Finalization`, whose moves are checked.
"""

from __future__ import annotations

from dbuffer.collectives import release_workspaces
from fsdp.group.profiling import label
from fsdp.unit.root import Finalization, RootContext, Unit
from fsdp.unit.training_state import TrainingState, in_backward

__all__ = ["end_backward", "finalize_backward", "finish_finalized", "finish_grad_sync"]


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
