"""How a group's weights move between the optimizer's shard and the modules: its ``weights`` part.

A :class:`~fsdp.group.param_group.ParameterGroup` drives the same cycle for every kind of
weights (refresh after the optimizer stepped, gather, hand the unsharded parameters to the
modules, free them) and leaves what is moved, and how, to its weights part:

* :class:`BufferWeights` (here, the default): the weights are DBuffers. A gather casts ``main``
  (the group's, which the optimizer updates) straight into this rank's row of its target, as
  FSDP2's copy-in does, and all-gathers in place: into ``unsharded`` (flat layouts) or into
  ``gathered``, copied out into ``unsharded`` (FSDP2's chunked layout); the modules compute with
  views of ``unsharded``. Where a gather cannot write its own row (HFSDP, host offload, ``Owned``
  buckets) it reads ``model``, the compute-dtype shard cast from ``main``.
* :class:`fsdp.compose.extensions.SubclassWeights`: tensor-subclass parameters (float8, NF4):
  the shards are pieces of the subclass itself and FSDP2's ``fsdp_pre_all_gather`` /
  ``fsdp_post_all_gather`` make what is gathered and what the modules compute with.

The part never sees its group: it is built from :class:`~fsdp.group.parts.WeightsParts` (what
is fixed for its life) and given the main weights, dtypes and siblings at every :meth:`build`; it
owns the buffers it creates and the unsharded parameters, so it hooks them for the unit
(:meth:`install_grad_hooks`). The methods below are the whole contract.
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
    """Weights held in DBuffers (see the module docstring for the buffers and their moves).

    ``model`` is ``main`` itself when dtype and placements agree (no copy, no cast). Otherwise a
    gather that can casts ``main`` into its own row of the target (:attr:`casts_into_gather`) and
    ``model`` holds no storage; else ``model`` is a cast of ``main`` kept between steps, or with
    ``persistent_param_shard=False`` a temporary cast before each gather (:attr:`lean_model`).
    Under HFSDP the model shard sits at other placements than ``main``
    (:attr:`GroupPlacements.model <fsdp.group.members.GroupPlacements>`) and a refresh casts
    ``main`` into ``cast_main`` and all-gathers that over the replicate axis."""

    dtype_fixed: Optional[str] = None  # module.to(dtype) is allowed
    # The plan's routes, taken by build() / replanned(): a gather casts main into its own row
    # (GatherSource.OWN_ROW); no model shard is kept between gathers (lean: nothing to refresh,
    # the model shard is not main); the refresh casts the model shard, which fsdp.optim's step
    # may write instead (ModelRefresh.CAST); HFSDP's refresh gathers it over the replicas; no_shard
    # under offload uploads the unsharded weights at the refresh.
    casts_into_gather = False
    lean_model = False
    step_writes_model = False
    _refresh: ModelRefresh = ModelRefresh.NONE
    _uploads_at_refresh = False
    # The model shard's storage goes while the unsharded weights stay gathered (its plan lifetime
    # ends at a forward or a gather: release_model_shard); a lean one on the host waits for the
    # upload that read it first.
    _frees_model_when_kept = False
    _settles_before_freeing_lean = False
    # FSDP2's set_keep_unsharded_storage: a reshard keeps the unsharded (and gathered) storage, so
    # their data pointers stay the same across steps (CUDA graph capture), for their memory.
    keep_unsharded_storage = False

    def __init__(self, parts: WeightsParts) -> None:
        self.parts = parts
        self.main: Optional[DBuffer] = None  # the group's main weights, dtypes and siblings: from build()
        self.dtypes: Optional[Dtypes] = None
        self.siblings: Optional[Siblings] = None
        self.hooks = GradHooks()
        self.model: Optional[DBuffer] = None
        self.unsharded: Optional[DBuffer] = None
        # The all-gather's target when the layout copies out of it (else gathers land in ``unsharded``).
        self.gathered: Optional[DBuffer] = None
        self.cast_main: Optional[DBuffer] = None  # HFSDP: main cast to the compute dtype, gathered from
        self.unsharded_params: Optional[list[nn.Parameter]] = None
        self._init_buffer: Optional[DBuffer] = None  # full main-dtype weights during init_weights
        self._version_before_gather = 0
        self._row: Optional[DBuffer] = None  # the gather's own row, cast from main by begin_gather
        self._row_of: Optional[tuple[DBuffer, DBuffer]] = None  # (target, its own row): a view, made once

    # ------------------------------------------------------------------ building

    def fill(self, tensors: list[torch.Tensor]) -> None:
        """Copy this rank's part of every (identically initialised) full tensor into ``main``."""
        self.parts.layout.fill(self.main, tensors)

    def build(self, plan: GroupPlan, main: DBuffer, dtypes: Dtypes, siblings: Siblings) -> None:
        """``model``, ``unsharded`` and the unsharded parameters (views of it, hooked) for the
        group's ``main`` weights in ``dtypes``, to run ``plan``'s routes; with a layout that
        copies, also ``gathered`` (storage only while a gather lands). Their values come from
        the next refresh / gather."""
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

    # ------------------------------------------------------------------ the model shard

    def version_key(self) -> int:
        """Changes when an in-place op autograd sees updates a parameter (``load_state_dict``, a
        for-loop optimizer). Foreach ops on DTensors do not bump it, hence also the group's
        unsharder's ``mark_stale``, called after every ``torch.optim`` optimizer step. Checked first, as at
        every refresh: no local tensor got FSDP2's extension methods after ``fully_shard``
        (:func:`_check_no_late_extension`)."""
        params = self.parts.sharded_params
        _check_no_late_extension(self.parts.infos, params)
        return sum(map(_VERSION, params)) + self.main.local_buffer._version

    def replanned(self, plan: GroupPlan) -> None:
        """Take the routes of ``plan`` (see the class attributes): at build, and when the
        group compiles its plan again."""
        self._refresh = plan.model_refresh
        self.casts_into_gather = plan.gather_source is GatherSource.OWN_ROW
        self.lean_model = plan.model_refresh is ModelRefresh.NONE and self.model is not self.main
        self.step_writes_model = plan.model_refresh is ModelRefresh.CAST
        self._uploads_at_refresh = plan.unsharding is Unsharding.UPLOAD_AT_REFRESH
        model = plan.buffer(Buf.MODEL)
        self._frees_model_when_kept = model is not None and model.lifetime in (Lifetime.REFRESH_TO_FORWARD, Lifetime.GATHER)
        self._settles_before_freeing_lean = self.lean_model and plan.config.residence is ResidenceKind.HOST

    def _release_lean_model(self) -> None:
        """Free a lean model shard once its gather has landed. Under host offload it is a host
        buffer the gather's non-blocking upload read (:mod:`fsdp.compose.offload`): that copy
        is settled first: the host never frees or writes a host buffer a copy may still read
        (the offload part's ordering rule; this device's allocator is not relied on for it)."""
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
        """The unsharded weights stay gathered from now until the main weights change (a unit
        that keeps them after forward, e.g. the root; ZeRO-1/2 after their gather): nothing reads
        the persistent model shard before the optimizer writes it again, so its storage goes now
        (``shard numel x param_dtype size``, alive at the backward peak otherwise). Should a
        gather come first after all (``reshard()``, micro-batches), it casts the shard again from
        the main weights: the same values, as ``persistent_param_shard=False`` does every time.
        Kept under HFSDP, where only a collective rebuilds it, and under offload (the plan's
        lifetime of the model shard says which)."""
        if self._frees_model_when_kept and not self.model.is_storage_released():
            self.model.release_storage()

    @without_grad
    def refresh(self, model_current: bool) -> None:
        """Bring the model shard up to date with the main weights: a local cast (unless
        ``model_current``: the optimizer wrote it already, or it is ``main`` itself), or HFSDP's
        cast and all-gather over the replicate axis; ``no_shard`` under offload uploads it
        straight into the unsharded weights."""
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

    # ------------------------------------------------------------------ gather

    def has_unsharded(self) -> bool:
        return not self.unsharded.is_storage_released()

    @property
    def shares_gather(self) -> bool:
        """Whether a unit may gather this part together with its other groups in one collective
        (:class:`~fsdp.group.shared_gather.SharedGather`): when its gather lands in rows that
        the layout copies out of anyway (FSDP2's chunked layout), not straight in the parameters."""
        return self.gathered is not None

    def begin_gather(self, kind: GatherKind = GatherKind.OWN) -> Optional[DBuffer]:
        """Before a gather of ``kind``, on the compute stream: unless it is ``SHARED`` (one
        collective with the unit's other groups, whose buffers it has), the target gets storage
        and is returned: the gathered buffer if the layout copies out of it, else the unsharded
        weights themselves. If the gather reads this rank's shard (not ``POST_FORWARD_SLICE``),
        the main weights are cast into the target's own row (:attr:`casts_into_gather`), or a
        released model shard is cast again."""
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
        """This rank's row of ``target`` (a local scatter: a view), made at the first gather into
        ``target``: releasing and reallocating its storage keeps the storage object the view reads."""
        if self._row_of is None or self._row_of[0] is not target:
            self._row_of = (target, target.scatter(target.mesh.ndim - 1))
        return self._row_of[1]

    def gather_source(self) -> DBuffer:
        """The sharded compute weights a gather reads: the target's own row that
        :meth:`begin_gather` cast the main weights into (the gather runs in place), else
        ``model``, or under offload its copy on the compute device (uploaded now, on the current
        stream: the gather's)."""
        row, self._row = self._row, None
        if row is not None:
            return row
        return self.parts.offload.upload(self.model)

    def gathered_buffer(self) -> DBuffer:
        """The buffer an all-gather of the weights fills."""
        return self.unsharded if self.gathered is None else self.gathered

    @without_grad
    def end_gather(self, refill: bool, rows: Optional[torch.Tensor] = None) -> None:
        """After the gather has landed: free the temporaries it read, and let a layout that
        copies move the gathered pieces (from ``rows``, where a gather shared with other groups
        landed, else from ``gathered``) into the unsharded parameters, which get their storage
        only now (as FSDP2's copy-out allocates them: a gather in flight, a prefetch, holds the
        gathered buffer alone, not both). ``refill``: the gather restored weights freed at
        reshard (ZeRO-3), values autograd may have saved in forward: not a modification, so the
        version counter is put back (DBuffer's refill guard covers the collective, this the
        copy-out)."""
        layout = self.parts.layout
        self.parts.offload.release_upload()
        self._release_lean_model()  # after the upload from it settled, under host offload
        if self.gathered is not None:
            with label("fsdp::copy_out"):
                self.unsharded.reallocate_storage()
                own = rows is None
                layout.copy_out(layout.rows(self.gathered.local_buffer) if own else rows, self.unsharded)
                if own and not self.keep_unsharded_storage:
                    self.gathered.release_storage()
        if refill:
            torch._C._autograd._unsafe_set_version_counter((self.unsharded.local_buffer,), (self._version_before_gather,))

    def free_unsharded(self) -> None:
        """After a reshard: release the unsharded storage (the next gather allocates it again),
        unless :attr:`keep_unsharded_storage`, when the next gather refills it in place."""
        if not self.keep_unsharded_storage and not self.unsharded.is_storage_released():
            self.unsharded.release_storage()

    def release_unsharded_tail(self, tail: ForwardOnlyTail) -> bool:
        """Free the unsharded storage from ``tail``'s first parameter on (the rest stays, for
        backward: :mod:`fsdp.group.forward_only`); False, freeing nothing, where the storage is
        kept between gathers (``keep_unsharded_storage``)."""
        if self.keep_unsharded_storage or self.unsharded_params is None or not self.has_unsharded():
            return False
        return tail.release(self.unsharded.local_buffer, self.unsharded_params)

    def keep_slice(self, post: PostForwardSlice) -> None:
        """Let ``post`` (:mod:`fsdp.compose.post_forward`) keep its slice of the gathered
        weights: copied out of the gathered buffer (flat), or rebuilt from the unsharded
        parameters (a layout that copies has freed it)."""
        if self.gathered is None:
            post.keep()
        else:
            fill = self.parts.layout.fill_slice
            post.keep(fill=lambda out, start, end: fill(self.unsharded, out, start, end))

    # ------------------------------------------------------------------ init_weights

    def init_params(self) -> list[nn.Parameter]:
        """Full plain parameters in the main dtype for an init function to fill: the main
        weights themselves when they are replicated (``no_shard``), otherwise a temporary
        replicated buffer of this group only, never of the whole model."""
        p, main = self.parts, self.main
        if p.strategy.shard_optim:
            self._init_buffer = p.layout.unsharded_buffer(main, p.placements.replicated, self.dtypes.main, main.device, True)
        target = self._init_buffer if self._init_buffer is not None else main
        return [p.kind.unsharded(k, target.get_local_tensor(k), p.requires_grad) for k in range(len(p.infos))]

    @without_grad
    def commit_init(self, commit: bool) -> None:
        """Keep this rank's part of the initialised full weights (a local copy, no
        communication) and drop the temporary buffer; ``commit=False`` only drops it."""
        buf, self._init_buffer = self._init_buffer, None
        if commit and buf is not None:
            self.fill([buf.get_local_tensor(k) for k in range(len(self.parts.infos))])


class GradHooks:
    """The unit's gradient hook of each unsharded parameter (``hook_for(k)``), registered on
    the parameters a weights part makes, now and whenever it makes them again."""

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
    """A plain parameter whose local tensor was given FSDP2's ``fsdp_pre_all_gather`` (or
    ``fsdp_post_all_gather``) after ``fully_shard``: its shard is the row-atomic layout's rows,
    not the padded ``torch.chunk`` piece the protocol assumes, so raise (before any gather)
    rather than silently gather plain values. Tensor subclasses get the protocol: see
    :mod:`fsdp.compose.extensions`. Checked at every refresh (a few attribute lookups per parameter)."""
    for info, p in zip(infos, sharded_params):
        local = getattr(p, "_local_tensor", p)
        if hasattr(local, "fsdp_pre_all_gather") or hasattr(local, "fsdp_post_all_gather"):
            raise TypeError(
                f"parameter {info.fqn!r}: its local tensor got fsdp_pre_all_gather/fsdp_post_all_gather after "
                f"fully_shard, but it was sharded as a plain tensor (row-atomic layout), so the extension "
                f"cannot be honoured. Make the parameter a tensor subclass defining both methods before fully_shard"
            )
