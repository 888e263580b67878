"""A group's gradients, from autograd's hooks to ``param.grad``: its :class:`GradReducer`.

It holds the gradients the unit's hooks hand it (:meth:`GradReducer.take`) until the group has them
all, only then packing them into ``grad_in`` (as FSDP2: allocated earlier, it would live through the
backward peak), reduces them into ``main_grad`` by the group's :class:`~fsdp.group.plan.ReducePlan`
and attaches ``param.grad``. ``main_grad`` has storage only from the first reduction after
``zero_grad()`` (:attr:`Reduction.OVERWRITE`) until the next drop, noticed at the root's next
forward (:meth:`GradReducer.release_dropped_grads`): between steps it costs nothing, as in FSDP2.
Built from :class:`~fsdp.group.grad_parts.GradParts`, the reducer never sees its group.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch.distributed.tensor import DTensor

from dbuffer import DBuffer, Pending, PreparedSlot
from fsdp.group.grad_mode import without_grad
from fsdp.group.grad_parts import GradParts
from fsdp.group.main_grad_state import ALLOWED, InFlight, MainGrad, Reduction, check_move
from fsdp.group.members import GroupPlacements
from fsdp.group.parts import Comms
from fsdp.group.plan import CommsKind, FoldWhen, GradsTo, ReduceCollective, ReducePlan, ReduceRoute, Where
from fsdp.group.policy import Dtypes, converted
from fsdp.group.reduction import ReduceSettings
from fsdp.group.profiling import label

__all__ = ["GradReducer", "InFlight", "Reduction"]


class GradReducer:
    """The gradient state of one group that requires grad; see the module docstring."""

    def __init__(self, parts: GradParts, placements: GroupPlacements, dtypes: Dtypes,
                 reduction: ReduceSettings, route: ReducePlan, comms: Comms) -> None:
        self.parts, self.placements, self.dtypes = parts, placements, dtypes
        self.replanned(route, comms, reduction)
        self.grad_in = parts.buffers.on_device(placements.partial, dtypes.reduce)
        self.grad_in.release_storage()
        self.main_grad = parts.buffers.where_main_lives(parts.main_grad_placements, dtypes.main_grad)
        self.main_grad_views = self.make_views()
        self.main_grad.release_storage()
        self._seen: set[int] = set()  # params whose gradient arrived in this backward
        self._local: set[int] = set()  # params with gradients in grad_in, not yet reduced
        self._in_main: set[int] = set()
        self._held: dict[int, torch.Tensor] = {}  # autograd's gradients, until the group has them all
        self._in_flight: Optional[InFlight] = None
        self._direct = PreparedSlot()  # grad_in reduced straight into main_grad: prepared once
        self._temporary: Optional[DBuffer] = None  # REDUCE_OUT, kept: storage only while a reduction uses it
        self._into_temporary = PreparedSlot()
        self._partial: Optional[DBuffer] = None  # HSDP's deferred (Partial x Shard) sums
        self._partial_members: set[int] = set()
        self._gaps: Optional[list[tuple[int, int]]] = None
        self.state = MainGrad.EMPTY
        self.cast_grads = True  # param.grad: a cast copy if dtypes differ (fsdp.optim: off)

    def _move(self, target: MainGrad) -> None:
        if target not in ALLOWED[self.state]:  # the names only for the message: off the hot path
            check_move(self.parts.names, self.state, target)
        self.state = target

    def replanned(self, route: ReducePlan, comms: Comms, reduction: ReduceSettings) -> None:
        """Run ``route`` by ``comms`` with ``reduction``'s settings from now on (a new plan)."""
        self.route, self.comms, self._prepares = route, comms, route.comms is CommsKind.DBUFFER
        self.reduction = reduction
        self._finishing = reduction.finishing(self.parts.mesh, self.parts.streams)

    def rebuilt(self, parts: GradParts) -> "GradReducer":
        """A fresh reducer of the group's new ``parts`` (``to_empty``), with the same settings."""
        fresh = GradReducer(parts, self.placements, self.dtypes, self.reduction, self.route, self.comms)
        fresh.cast_grads = self.cast_grads
        return fresh

    def make_views(self) -> list[DTensor]:
        """``param.grad`` / ``param.main_grad``: DTensor views of ``main_grad`` (needs storage)."""
        parts, view = self.parts, self.main_grad
        if view.placements != parts.param_placements:  # ``optim``: whole grads, sharded parameters
            view = view.redistribute(parts.param_placements)
        return parts.layout.views(view, parts.kind, parts.outer_placements)

    # ------------------------------------------------------------------ from autograd

    def starts_round(self) -> bool:
        """Whether the next gradient is the group's first of a backward round."""
        return not self._seen

    def take(self, k: int, grad: torch.Tensor) -> bool:
        """Hold parameter ``k``'s gradient (no tensor op on the hot path); True once the group has
        them all this round (reentrant checkpointing: once per round). The unit then frees the
        weights before :meth:`pack_held` (FSDP2's order)."""
        if self._in_flight is not None:  # left in flight by set_is_last_backward(False)
            self.finish_reduce()
        self._seen.add(k)
        if not self._local:  # hold autograd's gradient; grad_in comes once the group is complete
            held = self._held.get(k)  # summed without a graph (create_graph=True runs hooks with grad on)
            self._held[k] = grad if held is None else held.detach() + grad.detach()
        else:
            self._pack(k, grad)
        if len(self._seen) < self.parts.count:
            return False
        self._seen.clear()
        return True

    @without_grad
    def _pack(self, k: int, grad: torch.Tensor, before_alloc: Optional[Callable] = None) -> None:
        """Copy/add one gradient into ``grad_in``, allocated first (after ``before_alloc()``)."""
        if not self._local:
            if before_alloc is not None:
                before_alloc()
            self.grad_in.reallocate_storage()
        self._write(k, grad, add=k in self._local)
        self._local.add(k)

    def _write(self, k: int, grad: Optional[torch.Tensor], add: bool = False) -> None:
        """Copy (``add``: add) parameter ``k``'s unsharded gradient into ``grad_in``; None: zero it."""
        parts = self.parts
        parts.layout.write_grad(self.grad_in, k, parts.kind.grad_local(k, grad), add)

    @without_grad
    def pack_held(self, before_alloc: Optional[Callable] = None) -> None:
        """Pack the held gradients into ``grad_in`` (allocated after ``before_alloc()``)."""
        held, self._held, parts = self._held, {}, self.parts
        if len(held) == parts.count and not self._local:
            if before_alloc is not None:
                before_alloc()
            self.grad_in.reallocate_storage()
            parts.layout.write_grads(self.grad_in, [parts.kind.grad_local(k, held[k]) for k in range(len(held))])
            self._local.update(held)
            return
        for k, grad in held.items():
            self._pack(k, grad, before_alloc)

    @without_grad
    def take_assigned_grads(self) -> None:
        """Take gradients assigned to unsharded ``.grad`` outside autograd (no hook saw them)."""
        params = self.parts.weights.unsharded_params
        if params is None:
            return
        for k, p in enumerate(params):
            grad, p.grad = p.grad, None
            if grad is None:
                continue
            if self._local:
                self._pack(k, grad)
            else:
                held = self._held.get(k)
                self._held[k] = grad if held is None else held + grad

    def end_backward(self) -> None:
        self.pack_held()  # gradients kept for a later (sync) backward live in grad_in
        self._seen.clear()

    def has_local_grads(self) -> bool:
        return bool(self._local or self._held)

    # ------------------------------------------------------------------ reduction

    def launch_reduce(self) -> None:
        """Average ``grad_in`` over the ranks, asynchronously, into ``main_grad`` or a temporary
        :meth:`finish_reduce` folds in (deferred HSDP: reduce-scatter only, keep partial sums)."""
        if not self.has_local_grads():
            return
        if self._in_flight is not None:  # it may still be reading grad_in
            self.finish_reduce()
        buffers, streams, reduce_dtype = self.parts.buffers, self.parts.streams, self.dtypes.reduce
        if self._held:
            self.pack_held()
        self._zero_unwritten()
        target_pl, route = self.main_grad.placements, self.route
        if route.collective is ReduceCollective.SHARD_AXIS_ONLY:
            partial_pl = self.placements.deferred
            with streams.launch(streams.reduce_scatter):
                pending = self._reduce_into(self.grad_in, partial_pl, buffers.on_device(partial_pl, reduce_dtype))
            self._partial_members |= self._local
            self._local = set()
            self._in_flight = InFlight(pending, Reduction.DEFERRED)
            return
        source, members = self.grad_in, self._local
        if route.grads_to is GradsTo.EVERY:  # every parameter's reduced gradient, zeros included
            members = set(range(self.parts.count))
        if self._partial is not None:  # reduce-scatter now, add the deferred sums, all-reduce below
            partial, self._partial = self._partial, None
            source = self._reduce_into(self.grad_in, partial.placements, buffers.on_device(partial.placements, reduce_dtype), async_op=False)
            source.local_buffer.add_(partial.local_buffer)
            members = members | self._partial_members
            self._partial_members = set()
        overwrite = self._overwrite_main_grad()
        self._in_main = set(members) if overwrite else self._in_main | members
        if overwrite:
            self.main_grad.reallocate_storage()
        kind = Reduction.OVERWRITE if overwrite else Reduction.ACCUMULATE
        step = route.overwrite if overwrite else route.accumulate
        folded = False
        with streams.launch(streams.reduce_scatter):
            if step is ReduceRoute.DIRECT:
                pending = self._reduce_into(source, target_pl, self.main_grad, kept=self._direct if source is self.grad_in else None)
            elif step is ReduceRoute.TEMPORARY:
                kept = self._into_temporary if source is self.grad_in else None
                pending = self._reduce_into(source, target_pl, self._reduce_out(target_pl, reduce_dtype), kept=kept)
                # Fold now, on this stream, if that blocks no host (FSDP2's order), so the temporary
                # dies before the next unit's backward (the plan says where that is allowed).
                if route.fold is FoldWhen.AT_LAUNCH_IF_FREE and streams.wait_is_free(pending):
                    self._fold(pending.wait(), kind)
                    folded = True
            else:  # IN_PLACE
                pending = self._allreduce_in_place()
        self._local = set()
        self._in_flight = InFlight(pending, kind, folded)

    def _reduce_into(self, source: DBuffer, placements: tuple, out: DBuffer, async_op: bool = True,
                     kept: Optional[PreparedSlot] = None):
        """``source.redistribute(placements, out=out)`` by the comms; ``kept``: a prepared slot."""
        with label("fsdp::reduce_scatter", call=self.parts.call_label):
            if kept is not None and self._prepares and async_op:
                return kept.start(source, placements, out)
            return self.comms.reduce(source, placements, out, async_op)

    def _reduce_out(self, placements: tuple, dtype: torch.dtype) -> DBuffer:
        """The reduction's temporary, allocated; kept unless its placements or dtype change."""
        out = self._temporary
        if out is None or out.placements != placements or out.dtype != dtype:
            out = self._temporary = self.parts.buffers.on_device(placements, dtype)
        else:
            out.reallocate_storage()
        return out

    def _release_temporary(self) -> None:
        if self._temporary is not None and not self._temporary.is_storage_released():
            self._temporary.release_storage()

    def defers_all_reduce(self) -> bool:
        """Whether a reduction now only reduce-scatters, keeping partial sums (deferred HSDP)."""
        return self.route.collective is ReduceCollective.SHARD_AXIS_ONLY

    def _allreduce_in_place(self) -> Pending:
        """All-reduce ``grad_in`` over every mesh axis in its own storage (the last one async)."""
        current, ndim = self.grad_in, self.parts.mesh.ndim
        for axis in range(ndim - 1):
            current = current.allreduce(axis, out=current)
        return current.allreduce(ndim - 1, out=current, async_op=True)

    @without_grad
    def _zero_unwritten(self) -> None:
        """Zero what no gradient wrote: padding, and unused parameters (they reduce as 0)."""
        buf = self.grad_in.local_buffer
        if self._gaps is None:
            self._gaps = self.parts.layout.padding(self.grad_in)
        for start, end in self._gaps:
            buf[start:end].zero_()
        count = self.parts.count
        if len(self._local) < count:
            for k in range(count):
                if k not in self._local:
                    self._write(k, None)

    def _overwrite_main_grad(self) -> bool:
        """Whether the next reduction replaces ``main_grad`` (grads dropped) or accumulates."""
        self._detect_zeroed()
        overwrite = not self.state.holds_gradients
        self._move(self.state.after_reduction())
        return overwrite

    @without_grad
    def finish_reduce(self) -> bool:
        """Wait for the reduction, fold it into ``main_grad`` and free ``grad_in``. True if one ran."""
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return False
        streams = self.parts.streams
        streams.wait(streams.reduce_scatter)  # first, as in wait_unshard: a custom comm copies in its wait
        result = flight.pending.wait()
        if flight.kind is Reduction.DEFERRED:
            if self._partial is None:
                self._partial = result
            else:
                self._partial.local_buffer.add_(result.local_buffer)
                result.release_storage()
        elif not flight.folded:
            self._fold(result, flight.kind)
        if not self._local:
            self.grad_in.release_storage()
        return True

    def _fold(self, result: DBuffer, kind: Reduction) -> None:
        """Divide/hook a landed ``result``, then replace or add (``kind``) it into ``main_grad``."""
        parts, overwrite = self.parts, kind is Reduction.OVERWRITE
        for step in self._finishing:
            step(result.local_buffer)
        if self.route.into is Where.HOST:  # to the host, off the compute stream (which need not wait)
            with parts.streams.launch(parts.streams.reduce_scatter):
                parts.offload.download(result.local_buffer, self.main_grad.local_buffer, add=not overwrite)
        elif result is not self.main_grad:
            if overwrite:
                self.main_grad.local_buffer.copy_(result.local_buffer)
            else:
                self.main_grad.local_buffer.add_(result.local_buffer)
            if result is not self.grad_in:  # a sharded temporary: free it now, not at the next gc
                result.release_storage()  # (the collective's handle and the buffer refer to each other)

    def discard_in_flight(self) -> None:
        """Drop the gradients not yet in ``main_grad`` (FSDP2's ``reset_iter_state``, after a failed
        pass), waiting for reductions in flight; earlier sums and launch-time folds stay."""
        flight, self._in_flight = self._in_flight, None
        if flight is not None:
            flight.pending.wait()
            self.parts.streams.wait(self.parts.streams.reduce_scatter)
            if flight.kind is Reduction.OVERWRITE:  # it wrote main_grad, which held nothing live
                self._move(self.state.without_values())
                self._in_main = set()
                if not self.state.attached:
                    self.main_grad.release_storage()
        self._local, self._held, self._seen = set(), {}, set()
        self._partial, self._partial_members = None, set()
        self._release_temporary()
        if not self.grad_in.is_storage_released():
            self.grad_in.release_storage()

    def busy(self) -> bool:
        """Whether gradients wait to be reduced or are being reduced."""
        return self.has_local_grads() or self._in_flight is not None or self._partial is not None

    def reduce_op_changed(self, placements: GroupPlacements) -> None:
        """The reduce op changed (not :meth:`busy`): rebuild ``grad_in`` at ``placements``."""
        self.placements = placements
        self.grad_in = self.parts.buffers.on_device(placements.partial, self.dtypes.reduce)
        self.grad_in.release_storage()
        self._gaps = None
        self._direct.clear()
        self._into_temporary.clear()

    # ------------------------------------------------------------------ main_grad and .grad

    def _detect_zeroed(self) -> None:
        """If the optimizer dropped every attached ``.grad``, free ``main_grad`` (dead values)."""
        if self.state.attached and all(p.grad is None for p in self.parts.sharded_params):
            self.drop_main_grads()

    def drop_main_grads(self) -> None:
        """Forget the reduced gradients: free ``main_grad`` until the next reduction overwrites it."""
        for p in self.parts.sharded_params:
            p.grad = None
        self._move(MainGrad.EMPTY)
        if self._in_flight is None and not self.main_grad.is_storage_released():
            self.parts.offload.settle()
            self.main_grad.release_storage()

    def params_with_grads(self) -> list[int]:
        """Indices of the parameters whose reduced gradients ``main_grad`` holds, in order."""
        return sorted(self._in_main) if self.state.holds_gradients else []

    def release_dropped_grads(self) -> None:
        """Called before forward: free main_grad if ``zero_grad()`` dropped the gradients."""
        self._detect_zeroed()

    @without_grad
    def attach_grads(self) -> None:
        """Point ``param.grad`` / ``param.main_grad`` at ``main_grad`` where a gradient came (unused
        ones keep ``None``: weight decay skips them), ``.grad`` cast if dtypes differ."""
        self.parts.offload.settle()  # the optimizer reads the gradients and writes the weights on the host
        self._detect_zeroed()
        if self.state.holds_gradients:
            self.point_grads()

    def point_grads(self) -> None:
        """Attach ``.grad`` / ``.main_grad`` of the parameters ``main_grad`` holds gradients of."""
        for k in sorted(self._in_main):
            p, view = self.parts.sharded_params[k], self.main_grad_views[k]
            p.main_grad = view
            if view.dtype == p.dtype:
                if p.grad is not view:
                    p.grad = view
            elif self.cast_grads:
                p.grad = view.to(p.dtype)
            else:  # fsdp.optim reads main_grad itself and zeroes it with drop_main_grads()
                continue
            if not self.state.attached:
                self._move(MainGrad.ATTACHED)

    @without_grad
    def zero_grad_buffer(self) -> None:
        """Zero the main grads (``.grad`` views stay attached) and drop unreduced local grads."""
        if self._in_flight is not None:
            self.parts.streams.wait(self.parts.streams.reduce_scatter)  # a folded reduction still adds on it
            self._in_flight.pending.wait()
            self._in_flight = None
            self._release_temporary()
        self.parts.offload.settle()
        self._local = set()
        self._held = {}
        if not self.grad_in.is_storage_released():
            self.grad_in.release_storage()
        self.main_grad.reallocate_storage()
        self.main_grad.local_buffer.zero_()
        for p in self.parts.sharded_params:
            if p.grad is not None and p.grad.dtype != self.dtypes.main_grad:
                p.grad.zero_()
        self._seen.clear()
        self._move(self.state.without_values())

    # ------------------------------------------------------------------ module.to(dtype)

    @without_grad
    def convert(self, dtypes, in_residence: Callable[[DBuffer], DBuffer]) -> None:
        """Rebuild ``grad_in`` and ``main_grad`` in ``dtypes`` (after the reduction in flight),
        casting held gradients; ``in_residence`` pins a rebuilt host buffer (or is the identity)."""
        self.finish_reduce()
        self.parts.offload.settle()
        self._detect_zeroed()
        old_in, old_main = self.grad_in, self.main_grad
        self.dtypes = dtypes
        self.grad_in = converted(old_in, dtypes.reduce)
        self.main_grad = in_residence(converted(old_main, dtypes.main_grad))
        self._direct.clear()
        self._into_temporary.clear()
        if self.main_grad is not old_main:
            self.main_grad_views = self.make_views()
        for new, old in ((self.grad_in, old_in), (self.main_grad, old_main)):
            if new is not old and old.is_storage_released():
                new.release_storage()
        self._held = {k: t.to(dtypes.model) for k, t in self._held.items()}

    def reattach_after_swap(self) -> None:
        """The sharded parameters were swapped (convert): point their ``.grad`` again if attached."""
        if self.state.attached:
            self.point_grads()
