"""How a group's weights move between the optimizer's shard and the modules: its ``weights`` part.

The group's :class:`~fsdp.group.unsharder.Unsharder` runs the cycle the unit drives (refresh
after the optimizer, gather, hand the unsharded parameters to the modules, free); this part
decides what moves:

* :class:`BufferWeights` (default): DBuffers. A gather casts ``main`` straight into this rank's row
  of its target, as FSDP2's copy-in does, and all-gathers in place: into ``unsharded`` (flat
  layouts) or into ``gathered``, copied out into ``unsharded`` (the chunked layout). Where a gather
  cannot write its own row (HFSDP, host offload, ``Owned`` buckets) it reads ``model``, the
  compute-dtype shard cast from ``main``.
* :class:`fsdp.compose.extensions.SubclassWeights`: tensor subclasses (float8, NF4), through
  FSDP2's ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``.

A part never sees its group: built from :class:`~fsdp.group.parts.WeightsParts` and given main
weights, dtypes and siblings at :meth:`build`, it owns its buffers and the unsharded parameters,
which it hooks for the unit. Its methods are the whole contract.
"""

from __future__ import annotations

import operator
from typing import Callable, Optional

import torch
import torch.nn as nn

from dbuffer import DBuffer
from fsdp.group.forward_only import ForwardOnlyTail
from fsdp.group.grad_mode import without_grad
from fsdp.group.parts import GatherKind, PostForwardSlice, WeightsParts
from fsdp.group.plan import Buf, GatherSource, GroupPlan, Lifetime, ModelRefresh, ResidenceKind, Unsharding
from fsdp.group.policy import Dtypes
from fsdp.group.profiling import label
from fsdp.group.siblings import Siblings

__all__ = ["BufferWeights", "GatherKind", "GradHooks"]

_VERSION = operator.attrgetter("_version")  # summed at every refresh: no Python frame per parameter


class BufferWeights:
    """Weights held in DBuffers: a gather casts ``main`` into this rank's row of its target, as
    FSDP2's copy-in (:attr:`casts_into_gather`), and all-gathers in place into ``unsharded`` or, for
    FSDP2's chunked layout, into ``gathered``, copied out. Where it cannot write its own row (HFSDP,
    host offload, ``Owned`` buckets) it reads ``model``: ``main`` if dtype and placements agree,
    else a cast kept between steps or, with ``persistent_param_shard=False``, per gather
    (:attr:`lean_model`). HFSDP's refresh gathers it over the replicas (from ``cast_main``)."""

    dtype_fixed: Optional[str] = None  # module.to(dtype) is allowed
    # The plan's routes, set by replanned() (step_writes_model: fsdp.optim's step casts model).
    casts_into_gather = False
    lean_model = False
    step_writes_model = False
    _refresh: ModelRefresh = ModelRefresh.NONE
    _uploads_at_refresh = False
    _frees_model_when_kept = False
    _settles_before_freeing_lean = False
    # FSDP2's set_keep_unsharded_storage: reshard keeps the storage (fixed pointers: CUDA graphs).
    keep_unsharded_storage = False

    def __init__(self, parts: WeightsParts) -> None:
        self.parts = parts
        self.main: Optional[DBuffer] = None
        self.dtypes: Optional[Dtypes] = None
        self.siblings: Optional[Siblings] = None
        self.hooks = GradHooks()
        self.model: Optional[DBuffer] = None
        self.unsharded: Optional[DBuffer] = None
        self.gathered: Optional[DBuffer] = None  # the all-gather's target if the layout copies out
        self.cast_main: Optional[DBuffer] = None  # HFSDP: main cast to the compute dtype, gathered from
        self.unsharded_params: Optional[list[nn.Parameter]] = None
        self._init_buffer: Optional[DBuffer] = None
        self._version_before_gather = 0
        self._row: Optional[DBuffer] = None
        self._row_of: Optional[tuple[DBuffer, DBuffer]] = None  # (target, its own row): a view, made once

    def fill(self, tensors: list[torch.Tensor]) -> None:
        """Copy this rank's part of every (identically initialised) full tensor into ``main``."""
        self.parts.layout.fill(self.main, tensors)

    def build(self, plan: GroupPlan, main: DBuffer, dtypes: Dtypes, siblings: Siblings) -> None:
        """Make ``model``, ``unsharded`` (with hooked parameter views) and, for a copying layout,
        ``gathered`` for ``main`` by ``plan``; values come at the next refresh / gather."""
        p, d, pl = self.parts, dtypes, self.parts.placements
        self.main, self.dtypes, self.siblings = main, dtypes, siblings
        self.cast_main = None
        if pl.model is None:
            self.model = main if d.model == d.main else siblings.where_main_lives(main.placements, d.model, zero_fill=True)
        else:  # HFSDP: larger than main's piece, rebuilt by a collective: always persistent
            self.model = siblings.on_device(pl.model, d.model, zero_fill=True)
            if d.model != d.main:
                self.cast_main = siblings.on_device(main.placements, d.model)
        self.gathered = None
        self._row_of = None  # a row of the buffers replaced here
        if p.layout.copies:
            self.gathered = siblings.on_device(pl.replicated, d.model)
            self.gathered.release_storage()
        if not p.strategy.shard_optim and not p.offload.on_host and not p.layout.copies:
            self.unsharded = self.model  # no_shard: the replicated model weights are the full ones
        else:
            self.unsharded = p.layout.unsharded_buffer(
                main, pl.replicated, d.model, siblings.device, zero_fill=not p.strategy.shard_params
            )
        self.replanned(plan)
        self._release_lean_model()
        self.unsharded_params = [p.kind.unsharded(k, self.unsharded.get_local_tensor(k), p.requires_grad) for k in range(len(p.infos))]
        self.hooks.hook(self.unsharded_params)
        if p.strategy.shard_params:  # gathered before each use (its views exist now)
            self.unsharded.release_storage()

    def install_grad_hooks(self, hook_for: Callable[[int], Callable[[torch.Tensor], None]]) -> None:
        self.hooks.install(hook_for, self.unsharded_params)

    def new_sharded_params(self) -> list[nn.Parameter]:
        """The parameters handed to users and optimizers: DTensor views of ``main``."""
        p = self.parts
        return [nn.Parameter(t, requires_grad=p.requires_grad) for t in p.layout.views(self.main, p.kind, tuple(p.placements.sharded[:-1]))]

    def version_key(self) -> int:
        """Bumped by in-place ops autograd sees on a parameter (not foreach DTensor ops: hence
        ``mark_stale`` after ``torch.optim`` steps); runs :func:`_check_no_late_extension`."""
        params = self.parts.sharded_params
        _check_no_late_extension(self.parts.infos, params)
        return sum(map(_VERSION, params)) + self.main.local_buffer._version

    def replanned(self, plan: GroupPlan) -> None:
        """Take ``plan``'s routes (see the class attributes): at build and at every recompile."""
        self._refresh = plan.model_refresh
        self.casts_into_gather = plan.gather_source is GatherSource.OWN_ROW
        self.lean_model = plan.model_refresh is ModelRefresh.NONE and self.model is not self.main
        self.step_writes_model = plan.model_refresh is ModelRefresh.CAST
        self._uploads_at_refresh = plan.unsharding is Unsharding.UPLOAD_AT_REFRESH
        model = plan.buffer(Buf.MODEL)
        self._frees_model_when_kept = model is not None and model.lifetime in (Lifetime.REFRESH_TO_FORWARD, Lifetime.GATHER)
        self._settles_before_freeing_lean = self.lean_model and plan.config.residence is ResidenceKind.HOST

    def _release_lean_model(self) -> None:
        """Free a lean model shard once its gather landed; under host offload, first settle the
        upload that read it (:mod:`fsdp.compose.offload`: never free a host buffer a copy reads)."""
        if self.lean_model:
            if self._settles_before_freeing_lean:
                self.parts.offload.settle()
            self.model.release_storage()

    def _cast_model(self) -> None:
        """Cast the main shard into the model shard (allocated first if released)."""
        if self.model.is_storage_released():
            self.model.reallocate_storage()
        self.main.cast(self.dtypes.model, out=self.model)

    def release_model_shard(self) -> None:
        """While the unsharded weights stay gathered until ``main`` changes (root, ZeRO-1/2), free
        the model shard: nothing reads it before the step rewrites it (lowers the backward peak).
        A gather that comes anyway (``reshard()``) casts it again from ``main``: the same values."""
        if self._frees_model_when_kept and not self.model.is_storage_released():
            self.model.release_storage()

    @without_grad
    def refresh(self, model_current: bool) -> None:
        """Update the model shard from ``main``: a local cast (unless ``model_current``: the step
        wrote it) or HFSDP's replica gather; offloaded ``no_shard`` uploads into ``unsharded``."""
        offload, route = self.parts.offload, self._refresh
        offload.settle()  # an upload may still read model
        if route is ModelRefresh.CAST:
            if not model_current:
                self._cast_model()
        elif route is not ModelRefresh.NONE:  # HFSDP: (cast and) gather over the replicas
            source = self.main if self.cast_main is None else self.main.cast(self.dtypes.model, out=self.cast_main)
            source.redistribute(self.parts.placements.model, out=self.model)
        if self._uploads_at_refresh:
            offload.upload(self.model, out=self.unsharded)  # no_shard: nothing to gather

    def has_unsharded(self) -> bool:
        return not self.unsharded.is_storage_released()

    def begin_gather(self, kind: GatherKind = GatherKind.OWN) -> Optional[DBuffer]:
        """Before a gather of ``kind``, on the compute stream: unless ``SHARED``, allocate and
        return the target. A gather from this rank's shard (not ``POST_FORWARD_SLICE``) gets
        ``main`` cast into its own row (:attr:`casts_into_gather`) or the model shard recast."""
        self._version_before_gather = self.unsharded.local_buffer._version
        from_shard, own_target = kind is not GatherKind.POST_FORWARD_SLICE, kind is not GatherKind.SHARED
        into_row = from_shard and own_target and self.casts_into_gather
        if from_shard and not into_row and self.model is not self.main and self.model.is_storage_released():
            self._cast_model()
        self._row = None
        if not own_target:
            return None
        target = self.gathered_buffer()
        target.reallocate_storage()
        if into_row:
            self._row = self.main.cast(self.dtypes.model, out=self._own_row(target))
        return target

    def _own_row(self, target: DBuffer) -> DBuffer:
        """This rank's row of ``target``: a view made once, valid across release/reallocate."""
        if self._row_of is None or self._row_of[0] is not target:
            self._row_of = (target, target.scatter(target.mesh.ndim - 1))
        return self._row_of[1]

    def gather_source(self) -> DBuffer:
        """The sharded weights a gather reads: the own row :meth:`begin_gather` cast into (an
        in-place gather), else ``model``, under offload uploaded now on the gather's stream."""
        row, self._row = self._row, None
        return row if row is not None else self.parts.offload.upload(self.model)

    def gathered_buffer(self) -> DBuffer:
        """The buffer an all-gather of the weights fills."""
        return self.unsharded if self.gathered is None else self.gathered

    @without_grad
    def end_gather(self, refill: bool, rows: Optional[torch.Tensor] = None) -> None:
        """After the gather landed: free what it read; copy ``rows`` (a shared gather's) or
        ``gathered`` out into ``unsharded``, allocated only now so a prefetch holds one buffer
        (FSDP2's order). ``refill`` (weights freed at reshard, which autograd may have saved): not a
        modification, so restore the version counter."""
        layout = self.parts.layout
        self.parts.offload.release_upload()
        self._release_lean_model()  # after the upload from it settled, under host offload
        if self.gathered is not None:
            with label("fsdp::copy_out"):
                self.unsharded.reallocate_storage()
                own = rows is None
                layout.copy_out(layout.gathered_rows(self.gathered) if own else rows, self.unsharded)
                if own and not self.keep_unsharded_storage:
                    self.gathered.release_storage()
        if refill:
            torch._C._autograd._unsafe_set_version_counter((self.unsharded.local_buffer,), (self._version_before_gather,))

    def free_unsharded(self) -> None:
        """After a reshard: release the unsharded storage unless :attr:`keep_unsharded_storage`."""
        if not self.keep_unsharded_storage and not self.unsharded.is_storage_released():
            self.unsharded.release_storage()

    def release_unsharded_tail(self, tail: ForwardOnlyTail) -> bool:
        """Free the unsharded storage from ``tail``'s first parameter on (the rest is for backward:
        :mod:`fsdp.group.forward_only`); False, freeing nothing, if ``keep_unsharded_storage``."""
        if self.keep_unsharded_storage or self.unsharded_params is None or not self.has_unsharded():
            return False
        return tail.release(self.unsharded.local_buffer, self.unsharded_params)

    def keep_slice(self, post: PostForwardSlice) -> None:
        """Let ``post`` (:mod:`fsdp.compose.post_forward`) keep its slice of the gathered weights."""
        if self.gathered is None:
            post.keep()
        else:
            fill = self.parts.layout.fill_slice
            post.keep(fill=lambda out, start, end: fill(self.unsharded, out, start, end))

    def init_params(self) -> list[nn.Parameter]:
        """Full main-dtype parameters to initialise: ``main`` if replicated, else a temporary."""
        p, main = self.parts, self.main
        if p.strategy.shard_optim:
            self._init_buffer = p.layout.unsharded_buffer(main, p.placements.replicated, self.dtypes.main, main.device, True)
        target = self._init_buffer if self._init_buffer is not None else main
        return [p.kind.unsharded(k, target.get_local_tensor(k), p.requires_grad) for k in range(len(p.infos))]

    @without_grad
    def commit_init(self, commit: bool) -> None:
        """Keep this rank's part of the initialised weights (if ``commit``), drop the temporary."""
        buf, self._init_buffer = self._init_buffer, None
        if commit and buf is not None:
            self.fill([buf.get_local_tensor(k) for k in range(len(self.parts.infos))])


class GradHooks:
    """The unit's gradient hook of each unsharded parameter (``hook_for(k)``), on remade ones too."""

    def __init__(self) -> None:
        self.hook_for: Optional[Callable[[int], Callable[[torch.Tensor], None]]] = None

    def install(self, hook_for: Callable[[int], Callable[[torch.Tensor], None]],
                params: Optional[list[nn.Parameter]]) -> None:
        """Hook ``params`` (None: not made yet) with ``hook_for``, and every later ones."""
        self.hook_for = hook_for
        self.hook(params)

    def hook(self, params: Optional[list[nn.Parameter]]) -> None:
        """Hook newly made unsharded parameters (nothing before :meth:`install`)."""
        if self.hook_for is not None and params is not None:
            for k, p in enumerate(params):
                p.register_post_accumulate_grad_hook(self.hook_for(k))


def _check_no_late_extension(infos: list, sharded_params: list[nn.Parameter]) -> None:
    """Raise TypeError before any gather if a plain parameter's local tensor got FSDP2's
    ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` after ``fully_shard``: its shard is
    row-atomic, not the padded ``torch.chunk`` piece the protocol assumes
    (:mod:`fsdp.compose.extensions`)."""
    for info, p in zip(infos, sharded_params):
        local = getattr(p, "_local_tensor", p)
        if hasattr(local, "fsdp_pre_all_gather") or hasattr(local, "fsdp_post_all_gather"):
            raise TypeError(
                f"parameter {info.fqn!r}: its local tensor got fsdp_pre_all_gather/fsdp_post_all_gather after "
                f"fully_shard, but it was sharded as a plain tensor (row-atomic layout), so the extension "
                f"cannot be honoured. Make the parameter a tensor subclass defining both methods before fully_shard"
            )
