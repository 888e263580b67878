"""ParameterGroup: one communication bucket of a unit's parameters, and the cycle its weights go through.

A group's parameters share a dtype, ``requires_grad``, a mesh, a sharding strategy and a shard
placement (see :mod:`fsdp.group.bucket`). On a 1-D mesh the shard axis is the mesh; on a 2-D mesh
(HSDP) the outer axis replicates and the inner one shards, so gathers stay inside a shard group
and one ``redistribute`` reduce-scatters inside it and all-reduces across replicas.

A group *has* its parts, each chosen by ``fully_shard`` and handed in:

* ``main``: the DBuffer of the weights the optimizer updates (sharded unless ``no_shard``); the
  registered parameters are DTensor views of it (or, for tensor subclasses, of their own pieces);
* ``layout`` (:mod:`fsdp.group.layouts`): where each parameter sits in the buffers and which
  copies a collective needs; ``kind``: how parameters are wrapped (plain, tensor-parallel);
* ``placements`` (:class:`~fsdp.group.members.GroupPlacements`): where each buffer lives on the mesh;
* ``weights`` (:mod:`fsdp.group.weights`): how the model weights are made from ``main``,
  gathered and freed: DBuffers (default), or tensor subclasses (:mod:`fsdp.compose.extensions`);
* ``grads`` (:class:`~fsdp.group.grads.GradReducer`): autograd's gradients to ``param.grad``;
* ``offload`` (a :class:`~fsdp.group.residence.Residence`: where the main weights, grads and
  optimizer state live), ``comms`` (:mod:`fsdp.group.comms`) and
  ``post_forward`` (:mod:`fsdp.compose.post_forward`): optional parts, called without asking
  which they are.

The cycle, driven by the unit's hooks (:mod:`fsdp.unit.state`): :meth:`refresh` after the
optimizer stepped, :meth:`unshard` / :meth:`wait_unshard` (all-gather on the all-gather stream,
:mod:`fsdp.group.streams`), :meth:`register_unsharded_params` / :meth:`register_sharded_params` on
the modules, :meth:`reshard` to free the unsharded weights. ``module.to`` and ``to_empty`` of a
group are :mod:`fsdp.group.convert` and :mod:`fsdp.group.meta_init`.
"""

from __future__ import annotations

from typing import Callable, Optional, Union, cast

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import Placement

from dbuffer import CallLabel, DBuffer, Owned, Pending, PreparedSlot
from fsdp.group.comms import DBUFFER_COMMS
from fsdp.group.forward_only import ForwardOnlyTail
from fsdp.group.grad_mode import without_grad
from fsdp.group.grads import GradReducer
from fsdp.group.layouts import PLAIN, ChunkedLayout, FlatLayout, ParamKind, flat_layout
from fsdp.group.members import GroupPlacements, ParamInfo, meta_error
from fsdp.group.parts import Comms, GatherKind, PostForwardSlice, SharedGatherPart, Weights
from fsdp.group.configure import config_of
from fsdp.group.plan import CommsKind, GatherSource, GroupPlan, Sharing, Unsharding, plan_group
from fsdp.group.policy import Dtypes, MixedPrecisionPolicy, Strategy
from fsdp.group.profiling import label
from fsdp.group.reduction import ReduceSettings
from fsdp.group.registration import Registrations
from fsdp.group.residence import NO_OFFLOAD, HostResidence, Residence
from fsdp.group.streams import CommStreams
from fsdp.group.unsharded_state import Unsharded, UnshardedLife
from fsdp.group.weights import BufferWeights

__all__ = ["ParameterGroup"]


class ParameterGroup:
    """The parts of one (dtype, requires_grad) bucket and the moves between them; see the module
    docstring. Built by ``fully_shard`` (every argument was checked there, before any
    collective): ``infos`` are the bucket's parameters with their registrations on the modules,
    in registration order (every rank packs the same bytes); ``strategy`` the ZeRO stage
    (:class:`~fsdp.group.policy.Strategy`: which of main weights, gradients and compute weights
    are sharded). Errors: :meth:`unshard` of a meta-built group raises FSDP2's ``RuntimeError``
    (initialise it first), and registering again after a module's parameter was replaced since
    ``fully_shard`` raises a ``RuntimeError`` naming it (:meth:`check_registered`)."""

    # reshard_after_forward=n: the 1/n slice kept between forward and backward (fsdp.compose.post_forward).
    post_forward: Optional[PostForwardSlice] = None

    def __init__(
        self,
        infos: list[ParamInfo],
        mesh: DeviceMesh,
        strategy: Strategy,
        dtypes: Dtypes,
        requires_grad: bool,
        shard: Placement = Shard(0),
        gradient_divide_factor: Optional[float] = None,
        policy: Optional[MixedPrecisionPolicy] = None,
        offload: Optional[Residence] = None,
        layout: Optional[Union[FlatLayout, ChunkedLayout]] = None,
        kind: ParamKind = PLAIN,
        placements: Optional[GroupPlacements] = None,
        weights: Callable[["ParameterGroup"], Weights] = BufferWeights,
        own_gather: bool = False,
        forward_only: Optional[ForwardOnlyTail] = None,
    ) -> None:
        """``shard``: ``Shard(0)`` (row-atomic packing) or ``dbuffer.Owned()`` (whole tensors on
        balanced owners) for the flat layouts. ``gradient_divide_factor``: divide the summed
        gradients by this instead of averaging over the mesh (e.g. expert weights, whose
        gradients already hold the contributions of a whole expert-parallel group). ``policy``:
        the policy ``dtypes`` came from; ``module.to(dtype)`` keeps the dtypes it set explicitly
        (None: every dtype follows). ``offload``: the group's offload part (a
        :class:`~fsdp.group.residence.Residence`; default none): :mod:`fsdp.compose.offload`'s
        keeps the main weights, main grads and optimizer state on the host (compute buffers on
        the mesh's device), :mod:`fsdp.compose.optim_state`'s the optimizer state only. ``layout``: default :func:`~fsdp.group.layouts.flat_layout`.
        ``kind``: how parameters are wrapped (:class:`~fsdp.group.layouts.ParamKind`).
        ``placements``: default :meth:`GroupPlacements.for_mesh` (HFSDP passes its own).
        ``weights``: builds the group's weights part (:mod:`fsdp.group.weights`). ``own_gather``:
        never share an all-gather with the unit's other groups (an explicit bucket).
        ``forward_only``: the part freeing the parameters only forward reads, last in ``infos``,
        after a forward that keeps the rest (:mod:`fsdp.group.forward_only`)."""
        self.infos = infos
        self.call_label = CallLabel(f"fsdp parameter group {self.names()}")  # its collectives' (lazy init names the unit)
        self.registrations = Registrations(infos)  # every module and name each parameter is registered under
        self.mesh = mesh
        self.strategy = strategy
        self.dtypes = dtypes
        self.policy = policy
        self.requires_grad = requires_grad
        self.kind = kind
        self.own_gather = own_gather
        self.forward_only = forward_only
        self.comms: Comms = DBUFFER_COMMS  # FSDP2's custom comm objects replace it (fsdp.compose.custom_comm)
        self.reduction = ReduceSettings(divide_factor=gradient_divide_factor)  # FSDP2's reduction knobs
        op = self.reduction.op
        self.placements = placements.with_reduce_op(op) if placements else GroupPlacements.for_mesh(mesh.ndim, shard, op)
        self.offload: Residence = offload if offload is not None else NO_OFFLOAD
        tensors = [kind.local(i.param) for i in infos]
        shapes = [tuple(t.shape) for t in tensors]
        self.layout = layout if layout is not None else flat_layout(shapes, mesh, strategy.shard_optim, shard)
        main_pl = self.placements.sharded if strategy.shard_optim else self.placements.replicated
        buffer_shapes, buffer_layout = self.layout.buffer_shapes()
        device = tensors[0].device  # meta: built under torch.device("meta"), so are the shards (FSDP2)
        self.place_main(main_pl, buffer_shapes, dtypes.main, buffer_layout, device)
        self.weights: Weights = weights(self)
        self.plan: GroupPlan = self.compile_plan()
        self._take_comms_route(self.plan)
        if not self.is_meta:
            self.weights.fill(tensors)
        self.weights.build(self.plan)
        self.sharded_params: list[nn.Parameter] = self.weights.new_sharded_params()
        self.registered: Optional[list[nn.Parameter]] = None  # what fsdp last put on the modules (None: the originals)
        self.initialising = False  # inside init_weights (fsdp.group.meta_init)
        self._stale = True  # the main weights changed since the last refresh
        self._key: object = None  # weights.version_key() at the last refresh
        self._written_key: object = None  # version_key() when fsdp.optim last wrote the model shard
        self._refreshes = 0
        self.unsharded = UnshardedLife(self.names)  # the unsharded weights' state and version
        self._gather_pending: Optional[Pending] = None
        self._shared: Optional[tuple[SharedGatherPart, int]] = None  # (SharedGather, part) of the gather in flight
        self.grads: Optional[GradReducer] = GradReducer(self, self.plan.reduce) if requires_grad else None
        self.refresh()

    # ------------------------------------------------------------------ the plan

    def compile_plan(self) -> GroupPlan:
        """The group's plan (:mod:`fsdp.group.plan`) for what it is now: its parts, dtypes,
        comms, reduction settings, kept storage and post-forward slice."""
        ranks = self.post_forward.ranks if self.post_forward is not None else None
        return plan_group(config_of(self, ranks))

    def replan(self) -> None:
        """Compile the plan again and hand its routes to the parts that run them: after
        anything it is compiled from changed (``module.to(dtype)``, a custom comm, a reduction
        setting, ``set_keep_unsharded_storage``, a post-forward slice), between steps."""
        self.plan = self.compile_plan()
        self._take_comms_route(self.plan)
        self.weights.replanned(self.plan)
        if self.grads is not None:
            self.grads.route = self.plan.reduce

    def _take_comms_route(self, plan: GroupPlan) -> None:
        """dbuffer's collectives, prepared once for a gather of buffers the weights part keeps
        (a fresh slot drops an earlier plan's), or FSDP2's custom comm objects."""
        self._dbuffer_comms = plan.config.comms is CommsKind.DBUFFER
        kept_source = plan.gather_source in (GatherSource.OWN_ROW, GatherSource.MAIN, GatherSource.MODEL)
        self._gathers = PreparedSlot() if self._dbuffer_comms and kept_source else None

    def set_reduction(self, **changes: object) -> None:
        """Change how the gradients are reduced (:meth:`GradReducer.set_reduction
        <fsdp.group.grads.GradReducer.set_reduction>`: raises, changing nothing, while some wait
        to be reduced), and the plan with it. Only for a group that requires grad (the unit's
        setters pick those)."""
        cast(GradReducer, self.grads).set_reduction(**changes)
        self.replan()

    # ------------------------------------------------------------------ buffers

    def place_main(self, placements, shapes, dtype: torch.dtype, layout, device: torch.device) -> None:
        """Allocate ``main`` on ``device`` (meta for a meta-built group, else this rank's device),
        or on the host under offload; the compute device and the streams follow. fully_shard
        checked that every rank builds the same unit, so no rank check here."""
        if not self.offload.on_host or device.type == "meta":
            self.main = DBuffer(self.mesh, placements, shapes, dtype, device, layout=layout, check_ranks=False)
            self.compute_device = self.main.device
        else:
            host = cast(HostResidence, self.offload)  # on_host
            self.main = host.buffer(self.mesh, placements, shapes, dtype, layout)
            self.compute_device = host.compute_device
        self.streams = CommStreams.for_device(self.compute_device)

    @property
    def is_meta(self) -> bool:
        """Built under ``torch.device("meta")`` and not yet given storage (``to_empty``)."""
        return self.main.device.type == "meta"

    def sibling(self, placements, dtype: torch.dtype, zero_fill: bool = True, device=None) -> DBuffer:
        """A sibling of ``main`` (same shapes and layout) on the compute device (or ``device``)."""
        return self.main.sibling(placements, dtype, self.compute_device if device is None else device, zero_fill=zero_fill)

    def host_sibling(self, placements, dtype: torch.dtype, zero_fill: bool = True) -> DBuffer:
        """A sibling of ``main`` where ``main`` lives: on the host (pinned) under offload."""
        if not self.offload.on_host or self.is_meta:
            return self.sibling(placements, dtype, zero_fill)
        host = cast(HostResidence, self.offload)  # on_host
        return host.buffer(self.mesh, placements, self.main.shapes, dtype, self.main.layout, zero_fill)

    def sharded_views(self, buf: DBuffer) -> list[torch.Tensor]:
        """The DTensor view of every parameter in a buffer at the sharded placements."""
        return self.layout.views(buf, self.kind, tuple(self.placements.sharded[:-1]))

    @property
    def unsharded_params(self) -> Optional[list[nn.Parameter]]:
        """What the modules compute with between :meth:`unshard` and :meth:`reshard`."""
        return self.weights.unsharded_params

    # ------------------------------------------------------------------ refresh after the optimizer

    def mark_stale(self, model_written: bool = False) -> None:
        """The main weights changed: refresh the model weights before the next use.
        ``model_written``: the caller also wrote the model shard from them (:mod:`fsdp.optim`
        does, in the optimizer's pass), so the refresh skips the cast unless the weights change
        again before it. A gather still in flight read the weights before the change: it lands
        now, as gathered from them, so that the next use gathers again instead of taking it (a
        prefetch nothing consumed, an ``unshard(async_op=True)`` not yet waited for)."""
        self.wait_unshard()
        self._stale = True
        self._written_key = self.weights.version_key() if model_written else None

    def is_current(self) -> bool:
        """Whether the model weights are up to date with the main weights: no :meth:`refresh`
        is pending (nothing marked them stale, no in-place update since the last one). A
        query: it changes nothing."""
        return not self._stale and self.weights.version_key() == self._key

    @without_grad
    def refresh(self) -> None:
        """Bring the model weights up to date with the main weights, if they changed (the
        optimizer stepped: :meth:`mark_stale`, or an in-place update the version key sees).
        ZeRO-3 gathers at the next :meth:`unshard`; ``optim``/``optim_grads`` keep their
        unsharded weights, so they gather now."""
        key = self.weights.version_key()
        if (not self._stale and key == self._key) or self.is_meta:  # meta: nothing until to_empty
            return
        with label("fsdp::optimizer_refresh"):
            self.weights.refresh(model_current=key == self._written_key)
            self._written_key = None
            if self.plan.unsharding is Unsharding.GATHER_AT_REFRESH:  # ZeRO-1/2
                self.unsharded.begin_gather()
                target = self.weights.begin_gather()
                self.all_gather(self.weights.gather_source(), target).wait()
                self.weights.end_gather(refill=False)
                self.weights.release_model_shard()  # gathered until the next step: read again only after it
        self._key, self._stale = key, False
        self._refreshes += 1
        if self.plan.unsharding is not Unsharding.GATHER_AT_UNSHARD:  # ZeRO-0/1/2: current from here to the next step
            if self.unsharded.state is not Unsharded.GATHERING:
                self.unsharded.begin_gather()  # ZeRO-0: the model weights are made from main here
            self.unsharded.gathered(self._refreshes)

    # ------------------------------------------------------------------ unshard / reshard

    def needs_gather(self) -> bool:
        """Whether :meth:`unshard` would launch a gather now (call :meth:`refresh` first): ZeRO-3
        weights not current and no gather in flight (a prefetch's source was refreshed at its
        launch). A query: it changes nothing."""
        if self._gather_pending is not None:
            return False
        gathers = self.plan.unsharding is Unsharding.GATHER_AT_UNSHARD  # ZeRO-3
        return gathers and not (self.unsharded.is_current(self._refreshes) and self.weights.has_unsharded())

    def prepare_gather(self) -> None:
        """Before a gather is decided: raise FSDP2's ``RuntimeError`` for a group still on the
        meta device, and bring the model weights up to date (:meth:`refresh`)."""
        if self.is_meta:
            raise RuntimeError(meta_error([i.fqn for i in self.infos]))
        self.refresh()

    def can_share_gather(self) -> bool:
        """Whether this group's next gather may be one collective with its unit's other groups
        (:mod:`fsdp.group.shared_gather`): its plan lets it (a ZeRO-3 gather into rows copied
        out of, by dbuffer's comms, of no explicit bucket) and no post-forward slice is to be
        gathered instead."""
        return self.plan.sharing is Sharing.MAY_SHARE and self.unsharded.state is not Unsharded.SLICE_KEPT

    def join_gather(self, pending: Pending, shared: SharedGatherPart, index: int) -> None:
        """Take part ``index`` of a gather shared with other groups (launched by
        :func:`fsdp.group.shared_gather.gather_together`) as this group's gather in flight."""
        self.unsharded.begin_gather()
        self._gather_pending = pending
        self._shared = (shared, index)

    def gather_in_flight(self) -> bool:
        """Whether a gather of this group (its own, or a part of a shared one) is in flight: its
        source was checked and refreshed at its launch. A query."""
        return self._gather_pending is not None

    def unshard(self, async_op: bool = False) -> None:
        """Make the unsharded weights current: all-gather (ZeRO-3) into the reused buffers."""
        self.prepare_gather()
        self.launch_gather(async_op)

    def launch_gather(self, async_op: bool = False) -> None:
        """:meth:`unshard` once :meth:`prepare_gather` ran (a unit prepares all its groups first,
        to share one gather between them)."""
        if not self.needs_gather():
            if self._gather_pending is not None and not async_op:
                self.wait_unshard()
            return
        post = self.post_forward
        if self.unsharded.state is Unsharded.SLICE_KEPT and self.unsharded.version != self._refreshes:
            self.post_forward.drop()  # the weights changed since forward
            self.unsharded.freed()
        sliced = self.unsharded.state is Unsharded.SLICE_KEPT  # backward after reshard_after_forward=n
        target = self.weights.begin_gather(GatherKind.POST_FORWARD_SLICE if sliced else GatherKind.OWN)
        self.unsharded.begin_gather()
        with self.streams.launch(self.streams.all_gather):
            if sliced:  # gathered within n ranks, from the kept slices
                with self.call_label:
                    self._gather_pending = post.gather()
            else:
                self._gather_pending = self.all_gather(self.weights.gather_source(), target)
        if not async_op:
            self.wait_unshard()

    def all_gather(self, source: DBuffer, target: DBuffer) -> Pending:
        """Gather ``source`` (sharded) into ``target`` (replicated), in flight, by the group's
        comms (dbuffer's, or FSDP2's comm objects: :mod:`fsdp.compose.custom_comm`)."""
        with label("fsdp::all_gather", call=self.call_label):
            if self._gathers is not None:
                return self._gathers.start(source, self.placements.replicated, target)
            return self.comms.all_gather(source, self.placements.replicated, target)

    def reduce_into(self, source: DBuffer, placements: tuple, out: DBuffer, async_op: bool = True,
                    kept: Optional[PreparedSlot] = None):
        """``source.redistribute(placements, out=out)`` by the group's comms (``kept``: the
        caller's slot, for buffers it keeps): a reduce-scatter (and HSDP's all-reduce), or an all-reduce."""
        with label("fsdp::reduce_scatter", call=self.call_label):
            if kept is not None and self._dbuffer_comms and async_op:
                return kept.start(source, placements, out)
            return self.comms.reduce(source, placements, out, async_op)

    def wait_unshard(self) -> None:
        """Finish the gather in flight, if any (this group's own, or its part of one shared with
        the unit's other groups): wait for it, let the weights part copy out, and mark the
        unsharded weights current for this refresh."""
        if self._gather_pending is None:
            return
        # The launch's event first: a custom comm's wait copies its output on this stream, and one
        # that returned no work is ordered by that event alone (FSDP2 waits in the same order).
        self.streams.wait(self.streams.all_gather)
        self._gather_pending.wait()
        self._gather_pending = None
        shared, self._shared = self._shared, None
        if shared is None:
            self.weights.end_gather(refill=True)
        else:
            gather, index = shared
            self.weights.end_gather(refill=True, rows=gather.rows(index))
            gather.copied_out()
        if self.post_forward is not None:
            self.post_forward.drop()
        self.unsharded.gathered(self._refreshes)

    def release_model_shard(self) -> None:
        """The unit keeps its unsharded weights until the next step: see
        :meth:`BufferWeights.release_model_shard <fsdp.group.weights.BufferWeights.release_model_shard>`."""
        self.weights.release_model_shard()

    def can_keep_post_forward_slice(self) -> bool:
        """Whether ``reshard_after_forward=n`` may keep a slice of this group: ZeRO-3 plain
        parameters on a 1-D mesh without offload, in a packed layout (row-atomic, ragged or
        FSDP2's chunks: :mod:`fsdp.compose.post_forward`). Not an ``Owned()`` group: its layout
        puts each tensor whole on one of the ``W`` ranks, which cuts into no ``Shard(0)`` slice
        for ``n`` ranks. Such a group, like every other one refused here, reshards fully after
        forward and gathers over the whole mesh in backward, as ``reshard_after_forward=True``."""
        return (
            self.weights.keeps_post_forward_slice and self.kind.plain and self.strategy.shard_params
            and self.mesh.ndim == 1 and not self.offload.on_host and not isinstance(self.placements.sharded[-1], Owned)
        )

    def reshard_after_forward(self) -> None:
        """After forward: keep this rank's ``1/n`` slice of the gathered weights if
        ``reshard_after_forward=n`` enabled it, then free them as :meth:`reshard` does."""
        post = self.post_forward
        if post is None:
            self.reshard()
            return
        self.wait_unshard()
        if self.unsharded.state is Unsharded.GATHERED and self.weights.has_unsharded():
            self.weights.keep_slice(post)
            self.weights.free_unsharded()
            self.unsharded.keep_slice()
        else:
            self._free_unsharded()

    def release_forward_only(self) -> None:
        """After a forward that keeps the unsharded weights for backward: free the parameters
        only forward reads (registering them sharded), if nothing took hold of them in forward
        (:mod:`fsdp.group.forward_only`); otherwise keep everything, as FSDP2 does."""
        tail = self.forward_only
        if tail is None or self.unsharded.state is not Unsharded.GATHERED or self.unsharded_params is None:
            return
        self.wait_unshard()
        params = self.unsharded_params
        if not tail.unheld(params) or not self.weights.release_unsharded_tail(tail):
            return
        self.unsharded.free_forward_only()
        self.register(self._forward_registration())

    def forward_only_modules(self) -> list[nn.Module]:
        """The modules reading the forward-only tail (a recomputation of one in backward must
        gather it again); [] without a tail."""
        start = self.forward_only.start if self.forward_only is not None else len(self.infos)
        return [m for info in self.infos[start:] for m, _ in info.registrations]

    def keep_forward_only(self) -> None:
        """Stop freeing the forward-only tail: a second forward came before the backward (two
        losses, a pipeline's micro-batches), and each would otherwise gather it again."""
        self.forward_only = None

    def forward_only_freed(self) -> bool:
        """Whether the parameters only forward reads are freed (backward needs no gather for them)."""
        return self.unsharded.state is Unsharded.FORWARD_ONLY_FREED

    def _forward_registration(self) -> list[nn.Parameter]:
        """What the modules hold once the forward-only tail is freed: unsharded before it, sharded from it."""
        start = cast(ForwardOnlyTail, self.forward_only).start
        return self.unsharded_params[:start] + self.sharded_params[start:]

    def reshard(self) -> None:
        """Free the unsharded weights (ZeRO-3 only: the other strategies keep them), and a
        post-forward slice kept for backward."""
        if self.plan.unsharding is not Unsharding.GATHER_AT_UNSHARD:
            return
        self.wait_unshard()
        if self.post_forward is not None:
            self.post_forward.drop()
        self._free_unsharded()

    def _free_unsharded(self) -> None:
        if self.plan.unsharding is Unsharding.GATHER_AT_UNSHARD:
            self.weights.free_unsharded()
            self.unsharded.freed()

    def forget_gathered(self) -> None:
        """The weights' buffers were rebuilt (``module.to``, ``to_empty``): nothing is gathered,
        and the next use refreshes."""
        self.unsharded.freed()
        if self.post_forward is not None:  # follow the new gathered buffer
            self.post_forward = self.post_forward.rebuilt(self.weights.gathered_buffer())
        self.mark_stale()

    def names(self) -> str:
        """The group's first parameter names, for error messages."""
        return ", ".join(repr(i.fqn) for i in self.infos[:3]) + (", ..." if len(self.infos) > 3 else "")

    # ------------------------------------------------------------------ registration

    def register_unsharded_params(self) -> None:
        """Register the unsharded (plain) parameters on their modules; see
        :meth:`check_registered` for when that raises instead (registering nothing)."""
        if self.unsharded_params is None:
            raise RuntimeError(f"parameters {self.names()} were never gathered; unshard the module first")
        if self.forward_only_freed():  # backward's registration: the freed tail stays sharded
            self.register(self._forward_registration())
            return
        self.register(self.unsharded_params)
        if self.forward_only is not None:
            self.forward_only.note_registration(self.unsharded_params)

    def register_sharded_params(self) -> None:
        """Register the sharded (DTensor) parameters on their modules (raises as
        :meth:`check_registered` does)."""
        self.register(self.sharded_params)

    def register(self, params: list[nn.Parameter]) -> None:
        """Put ``params`` on the modules in place of each parameter's registrations (tied ones
        included); raises, registering nothing, as :meth:`check_registered` does."""
        self.registrations.put(params, self.registered, self._owner)
        if params is self.unsharded_params and not hasattr(params[0], "_fsdp_unsharded"):
            for p in params:  # found by the optimizer-step pre-hook (fsdp.optim.step_hooks)
                p._fsdp_unsharded = True
        self.registered = params

    def check_registered(self) -> None:
        """Raise if a module no longer holds the parameter fsdp registered there
        (:meth:`Registrations.check <fsdp.group.registration.Registrations.check>`)."""
        self.registrations.check(self.registered, self._owner)

    def _owner(self) -> str:
        return getattr(self.sharded_params[0], "_fsdp_owner", "its fsdp unit")

