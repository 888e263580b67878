"""Gradient reduction of a :class:`~fsdp.group.param_group.ParameterGroup`: the :class:`GradReduction` mixin.

What it owns: the post-accumulate-grad hooks on the unsharded parameters; holding autograd's
gradients until the group has them all, then packing them into ``grad_in`` (allocated only
then); launching the reduce-scatter (sharded main grads) or all-reduce and finishing it into
``main_grad`` (divide, hook, offload download, HSDP's deferred all-reduce); the lifetime of
``main_grad``; and attaching ``param.grad`` / ``param.main_grad`` to it.

``main_grad``'s lifetime: its storage exists only from the first reduction after the optimizer
dropped the gradients (``zero_grad()``, set_to_none) until the next such drop, which the root's
next forward notices for every unit (:meth:`GradReduction.release_dropped_grads`): between steps
it costs nothing, as in FSDP2. A reduction after such a drop overwrites ``main_grad``, later
ones (micro-batches) accumulate into it.

Why a mixin and not an object of its own: every step here reads the group's buffers
(``grad_in``, ``main_grad``), placements, strategy, dtypes, streams and reduction settings, and
the subclasses (:mod:`fsdp.group.chunked`, :mod:`fsdp.compose.extensions`, :mod:`fsdp.compose.tensor_parallel`,
:mod:`fsdp.compose.outer_shard`) override some of these methods; as methods of the group they keep one
``self`` and the overrides apply unchanged (the same reasoning as :class:`fsdp.group.meta_init.MetaInit`).
"""

from __future__ import annotations

import weakref
from dataclasses import replace
from typing import TYPE_CHECKING, Callable, Optional

import torch
from torch.distributed.tensor import DTensor

from dbuffer import DBuffer, Pending

if TYPE_CHECKING:
    from fsdp.group.param_group import ParameterGroup

__all__ = ["GradReduction"]


class GradReduction:
    """Mixin of :class:`~fsdp.group.param_group.ParameterGroup`: its gradients from autograd's hooks
    to ``param.grad`` (see the module docstring)."""

    def _init_grads(self) -> None:
        s, d, pl = self.strategy, self.dtypes, self.placements
        self.grad_in = self._new(pl.partial, d.reduce, zero_fill=False)
        self.grad_in.release_storage()
        self.main_grad = self._host(pl.sharded if s.shard_grads else pl.replicated, d.main_grad, zero_fill=False)
        self.main_grad_views = self._main_grad_views()
        self.main_grad.release_storage()  # allocated again by the first reduction
        self._seen: set[int] = set()  # params whose gradient arrived in this backward
        self._local: set[int] = set()  # params with gradients in grad_in, not yet reduced
        self._in_main: set[int] = set()  # params with gradients in main_grad
        self._reduce: Optional[tuple[Pending, Optional[bool]]] = None  # (pending, overwrite; None: partial)
        # HSDP with set_requires_all_reduce(False): reduce-scattered, not yet all-reduced sums
        # (placements Partial x Shard) and the parameters they hold gradients of.
        self._partial: Optional[DBuffer] = None
        self._partial_members: set[int] = set()
        self._gaps: Optional[list[tuple[int, int]]] = None  # padding of grad_in, found once
        # Autograd's gradients are held as they come and ``grad_in`` is allocated only once the
        # group has them all (FSDP2 does the same with its reduce-scatter input): a full-size
        # ``grad_in`` from the first gradient on would live through the unit's backward, whose
        # start (all activations still alive) is a step's memory peak, and the gradient of a
        # root holding the embedding and the head would span the whole backward.
        self._held: dict[int, torch.Tensor] = {}
        self._main_grad_has_data = False  # False: the next reduction overwrites main_grad
        self._grads_attached = False  # main_grad's storage: allocated by the first reduction
        # Whether ``param.grad`` gets a cast copy when main grads are in another dtype than the
        # main weights; fsdp.optim's flat optimizers turn it off (they upcast chunk by chunk).
        self.cast_grads = True

    def _main_grad_views(self) -> list[DTensor]:
        """``param.grad`` / ``param.main_grad`` of each parameter: DTensor views of ``main_grad``."""
        s, pl = self.strategy, self.placements
        # ``optim``: the grads are whole on every rank but the parameters are shards of them.
        view = self.main_grad.redistribute(pl.sharded) if s.shard_optim and not s.shard_grads else self.main_grad
        return self._sharded_views(view)

    def register_grad_hooks(
        self,
        on_group_done: Callable[["ParameterGroup"], None],
        on_group_start: Callable[["ParameterGroup"], None],
        on_first_grad: Callable[["ParameterGroup"], None] = lambda group: None,
    ) -> None:
        """Take each unsharded gradient from autograd as soon as it is accumulated, hold it until
        the group has all of them, then copy them into ``grad_in``; report the group's first
        gradient of a backward, when ``grad_in`` is about to be allocated and when the whole
        group has its gradients."""
        # The hooks live on our own parameters: holding the group or the state strongly would make
        # a reference cycle through autograd's C++ hook table, which the garbage collector cannot
        # see, and a sharded module would never be freed.
        callbacks = [_weak_callable(f) for f in (on_group_done, on_group_start, on_first_grad)]
        self._grad_callbacks = callbacks  # convert() hooks its new unsharded parameters too
        self._hook_unsharded_params()

    def _hook_unsharded_params(self) -> None:
        callbacks = self._grad_callbacks
        for k, p in enumerate(self.unsharded_params):
            p.register_post_accumulate_grad_hook(_grad_hook(weakref.ref(self), k, callbacks))

    @torch.no_grad()
    def _on_grad(self, k: int, p: torch.Tensor, on_group_done, on_group_start, on_first_grad) -> None:
        grad, p.grad = p.grad, None
        if grad is None:
            return
        if self._reduce is not None:  # left in flight by set_is_last_backward(False)
            self.finish_reduce()
        if not self._seen:
            on_first_grad(self)
        self._seen.add(k)
        if not self._local:  # hold autograd's gradient; grad_in comes once the group is complete
            held = self._held.get(k)
            self._held[k] = grad if held is None else held + grad
        else:
            self._pack(k, grad, on_group_start)
        if len(self._seen) == len(self.infos):
            self._pack_held(on_group_start)
            # Counted afresh: a unit run twice whose gradients arrive in two rounds of one
            # backward (reentrant checkpointing: each recomputation has its own nested
            # backward) completes the group once per round, not at every later gradient.
            self._seen.clear()
            on_group_done(self)

    def _pack(self, k: int, grad: torch.Tensor, on_group_start=None) -> None:
        """Write one gradient into ``grad_in``: the first of a parameter is copied, later ones
        (micro-batches) added; what no gradient wrote is zeroed before the reduction."""
        if not self._local:
            if on_group_start is not None:
                on_group_start(self)
            self.grad_in.reallocate_storage()
        self._write_grad(k, grad, add=k in self._local)
        self._local.add(k)

    def _write_grad(self, k: int, grad: Optional[torch.Tensor], add: bool = False) -> None:
        """Copy (``add``: add) parameter ``k``'s unsharded gradient into ``grad_in``; None: zero it."""
        self.layout.write_grad(self.grad_in, k, self.kind.grad_local(k, grad), add)

    @torch.no_grad()
    def _pack_held(self, on_group_start=None) -> None:
        held, self._held = self._held, {}
        for k, grad in held.items():
            self._pack(k, grad, on_group_start)

    def end_backward(self) -> None:
        self._pack_held()  # gradients kept for a later (sync) backward live in grad_in
        self._seen.clear()

    def has_local_grads(self) -> bool:
        return self.requires_grad and bool(self._local or self._held)

    def launch_reduce(self) -> None:
        """Average ``grad_in`` over the ranks, asynchronously: reduce-scatter for sharded main
        grads, all-reduce otherwise; straight into ``main_grad`` when it is overwritten in the
        same dtype, else into a temporary (sharded, or ``grad_in`` itself) folded in by
        :meth:`finish_reduce`. On an HSDP mesh with ``reduction.all_reduce`` off, reduce-scatter
        only and keep the partial sums for the next reduction that all-reduces (FSDP2's
        ``set_requires_all_reduce(False)``)."""
        if not (self._local or self._held):
            return
        if self._reduce is not None:  # it may still be reading grad_in
            self.finish_reduce()
        self._pack_held()
        self._zero_unwritten()
        target_pl = self.main_grad.placements
        if self._defers_all_reduce():
            partial_pl = self._deferred_placements(target_pl)
            with self.streams.launch(self.streams.reduce_scatter):
                pending = self.reduce_into(self.grad_in, partial_pl, self._new(partial_pl, self.dtypes.reduce))
            self._partial_members |= self._local
            self._local = set()
            self._reduce = (pending, None)
            return
        source, members = self.grad_in, self._local
        if self.reduction.unused_params:  # every parameter's reduced gradient, zeros included
            members = set(range(len(self.infos)))
        if self._partial is not None:  # reduce-scatter now, add the deferred sums, all-reduce below
            partial, self._partial = self._partial, None
            source = self.reduce_into(self.grad_in, partial.placements, self._new(partial.placements, self.dtypes.reduce), async_op=False)
            source.local_buffer.add_(partial.local_buffer)
            members = members | self._partial_members
            self._partial_members = set()
        overwrite = self._overwrite_main_grad()
        self._in_main = set(members) if overwrite else self._in_main | members
        direct = overwrite and self.dtypes.reduce == self.dtypes.main_grad and self.offload is None
        if overwrite:
            self.main_grad.reallocate_storage()
        with self.streams.launch(self.streams.reduce_scatter):
            if direct:
                pending = self.reduce_into(source, target_pl, self.main_grad)
            elif self.strategy.shard_grads:
                pending = self.reduce_into(source, target_pl, self._new(target_pl, self.dtypes.reduce))
            else:
                pending = self._allreduce_in_place()
        self._local = set()
        self._reduce = (pending, overwrite)

    def _deferred_placements(self, target_pl: tuple) -> tuple:
        """Where reduce-scattered sums wait while the all-reduce across replicas is deferred:
        sharded on the shard axis (the last), still partial on the replicate axis."""
        return self.placements.partial[:-1] + target_pl[-1:]

    def _defers_all_reduce(self) -> bool:
        return self.mesh.ndim == 2 and not self.reduction.all_reduce and self.strategy.shard_grads

    def set_reduction(self, **changes) -> None:
        """Change :attr:`reduction` (field=value), between steps: a different reduce op rebuilds
        the (then empty) gradient buffer with the new ``Partial`` placements. Raises, changing
        nothing, while gradients of this group wait to be reduced or are being reduced."""
        new = replace(self.reduction, **changes)
        if not new.all_reduce and self.mesh.ndim == 2 and self.requires_grad and not self.strategy.shard_grads:
            raise ValueError(
                f"set_requires_all_reduce(False) defers the all-reduce across replicas of reduce-scattered "
                f"gradients; parameters {self._names()} use sharding_strategy {self.strategy.name!r}, whose "
                f"gradients are not reduce-scattered. Use set_requires_gradient_sync(False) instead"
            )
        if new.op != self.reduction.op and self.requires_grad:
            if self._local or self._held or self._reduce is not None or self._partial is not None:
                raise RuntimeError(
                    f"cannot change how gradients of {self._names()} are reduced while some wait to be "
                    f"reduced; change it before the backward (or after finish_grad_sync())"
                )
            self.placements = self._group_placements(self.placements.sharded[-1], new.op)
            self.grad_in = self._new(self.placements.partial, self.dtypes.reduce, zero_fill=False)
            self.grad_in.release_storage()
            self._gaps = None
        elif new.op != self.reduction.op:
            self.placements = self._group_placements(self.placements.sharded[-1], new.op)
        self.reduction = new

    def discard_grads_in_flight(self) -> None:
        """Drop every gradient not yet folded into ``main_grad`` (after a failed forward or
        backward, FSDP2's ``reset_iter_state``): reductions in flight are waited for and their
        results dropped, local and deferred gradients freed. ``main_grad`` keeps what earlier
        steps reduced."""
        if not self.requires_grad:
            return
        if self._reduce is not None:
            pending, overwrite = self._reduce
            self._reduce = None
            pending.wait()
            self.streams.wait(self.streams.reduce_scatter)
            if overwrite:  # it wrote main_grad, which held nothing live: it holds nothing again
                self._main_grad_has_data = False
                self._in_main = set()
                if not self._grads_attached:
                    self.main_grad.release_storage()
        self._local, self._held, self._seen = set(), {}, set()
        self._partial, self._partial_members = None, set()
        if not self.grad_in.is_storage_released():
            self.grad_in.release_storage()

    @torch.no_grad()
    def _zero_unwritten(self) -> None:
        """Zero what no gradient wrote since ``grad_in`` was allocated: the layout's padding and
        the parameters that got no gradient (they reduce as 0, as unused parameters should)."""
        buf = self.grad_in.local_buffer
        for start, end in self._padding():
            buf[start:end].zero_()
        if len(self._local) < len(self.infos):
            for k in range(len(self.infos)):
                if k not in self._local:
                    self._write_grad(k, None)

    def _padding(self) -> list[tuple[int, int]]:
        """Ranges of ``grad_in``'s (full) local buffer that belong to no parameter (found once)."""
        if self._gaps is None:
            self._gaps = self.layout.padding(self.grad_in)
        return self._gaps

    def _allreduce_in_place(self) -> Pending:
        """All-reduce ``grad_in`` over every mesh axis in its own storage (the last one async)."""
        current = self.grad_in
        for axis in range(self.mesh.ndim - 1):
            current = current.allreduce(axis, out=current)
        return current.allreduce(self.mesh.ndim - 1, out=current, async_op=True)

    def _overwrite_main_grad(self) -> bool:
        """Whether the next reduction replaces ``main_grad`` (it was zeroed: the optimizer set
        every ``.grad`` to None since we attached them) or accumulates into it (micro-batches)."""
        self._detect_zeroed()
        overwrite = not self._main_grad_has_data
        self._main_grad_has_data = True
        return overwrite

    def _detect_zeroed(self) -> None:
        """The optimizer dropped every ``.grad`` we attached: main_grad's values are dead, so its
        storage goes until the next reduction rewrites it."""
        if self._grads_attached and all(p.grad is None for p in self.sharded_params):
            self.drop_main_grads()

    def drop_main_grads(self) -> None:
        """Forget the reduced gradients (``zero_grad()`` with set_to_none, or :mod:`fsdp.optim`'s):
        the next reduction overwrites ``main_grad``, whose storage goes until then."""
        for p in self.sharded_params:
            p.grad = None
        self._main_grad_has_data = False
        self._grads_attached = False
        if self._reduce is None and not self.main_grad.is_storage_released():
            self._settle()
            self.main_grad.release_storage()

    def params_with_grads(self) -> list[int]:
        """Indices of the parameters whose reduced gradients ``main_grad`` holds, in order."""
        if not self.requires_grad or not self._main_grad_has_data:
            return []
        return sorted(self._in_main)

    def release_dropped_grads(self) -> None:
        """Called before forward: free main_grad if ``zero_grad()`` dropped the gradients."""
        if self.requires_grad:
            self._detect_zeroed()

    @torch.no_grad()
    def finish_reduce(self) -> bool:
        """Wait for the reduction, fold it into ``main_grad`` and free ``grad_in``. True if one ran."""
        if self._reduce is None:
            return False
        pending, overwrite = self._reduce
        self._reduce = None
        if overwrite is None:  # reduce-scattered only (HSDP, all-reduce deferred): keep the sums
            result = pending.wait()
            self.streams.wait(self.streams.reduce_scatter)
            if self._partial is None:
                self._partial = result
            else:
                self._partial.local_buffer.add_(result.local_buffer)
                result.release_storage()
            if not self._local:
                self.grad_in.release_storage()
            return True
        result = pending.wait()
        self.streams.wait(self.streams.reduce_scatter)
        self.reduction.finish(result.local_buffer, self.mesh)  # divide, hook (FSDP2's knobs)
        if self.offload is not None:  # to the host, off the compute stream (which need not wait)
            with self.streams.launch(self.streams.reduce_scatter):
                self.offload.download(result.local_buffer, self.main_grad.local_buffer, add=not overwrite)
        elif result is not self.main_grad:
            if overwrite:
                self.main_grad.local_buffer.copy_(result.local_buffer)
            else:
                self.main_grad.local_buffer.add_(result.local_buffer)
            if result is not self.grad_in:  # a sharded temporary: free it now, not at the next gc
                result.release_storage()  # (the collective's handle and the buffer refer to each other)
        if not self._local:
            self.grad_in.release_storage()
        return True

    @torch.no_grad()
    def attach_grads(self) -> None:
        """Point ``param.grad`` / ``param.main_grad`` of the sharded parameters at ``main_grad``,
        for the parameters that received a gradient (unused ones keep ``grad=None``, as in
        single-process training, so weight decay and momentum skip them).

        When the main-grad dtype differs from the main-weight dtype, ``param.grad`` is a cast copy
        (torch requires ``grad.dtype == param.dtype``); zero it with ``zero_grad()`` (set_to_none)
        or :meth:`zero_grad_buffer`.
        """
        self._settle()  # the optimizer reads the gradients and writes the weights on the host
        self._detect_zeroed()
        if not self._main_grad_has_data:
            return
        self._point_grads()

    def _point_grads(self) -> None:
        for k in sorted(self._in_main):
            p, view = self.sharded_params[k], self.main_grad_views[k]
            p.main_grad = view
            if view.dtype == p.dtype:
                if p.grad is not view:
                    p.grad = view
            elif self.cast_grads:
                p.grad = view.to(p.dtype)
            else:  # fsdp.optim reads main_grad itself and zeroes it with drop_main_grads()
                continue
            self._grads_attached = True

    @torch.no_grad()
    def zero_grad_buffer(self) -> None:
        """Zero the main grads (``.grad`` views stay attached) and drop unreduced local grads."""
        if self._reduce is not None:
            self._reduce[0].wait()
            self._reduce = None
        self._settle()
        self._local = set()
        self._held = {}
        if not self.grad_in.is_storage_released():
            self.grad_in.release_storage()
        self.main_grad.reallocate_storage()
        self.main_grad.local_buffer.zero_()
        for p in self.sharded_params:
            if p.grad is not None and p.grad.dtype != self.dtypes.main_grad:
                p.grad.zero_()
        self._seen.clear()
        self._main_grad_has_data = False


def _weak_callable(fn: Callable) -> Callable[[], Optional[Callable]]:
    """A weak reference to a bound method; other callables are held strongly."""
    if hasattr(fn, "__self__") and hasattr(fn, "__func__"):
        return weakref.WeakMethod(fn)
    return lambda: fn


def _grad_hook(group_ref, k: int, callback_refs) -> Callable[[torch.Tensor], None]:
    def hook(p: torch.Tensor) -> None:
        group, callbacks = group_ref(), [ref() for ref in callback_refs]
        if group is not None and None not in callbacks:
            group._on_grad(k, p, *callbacks)

    return hook
