"""A group's plan as data: every buffer it holds and the route each phase takes, from its config.

:func:`plan_group` turns a :class:`GroupConfig` (plain values ``fully_shard`` and the unit's setters
decided) into a frozen :class:`GroupPlan`: each buffer (:class:`BufferPlan`) and each phase's route,
decided once by a pure function importing none of the parts it plans, rather than by each part on
every call (``tests/fsdp/test_group_plan*.py`` check it). Groups recompile it (``replan()``) on
config changes (:mod:`fsdp.group.configure`). Not planned: ``init_weights``' temporaries, custom
comms' staging buffers, a unit's shared gather (:mod:`fsdp.group.shared_gather`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

import torch

from fsdp.group.policy import Dtypes, Strategy

__all__ = ["BufferPlan", "GroupConfig", "GroupPlan", "ReducePlan", "can_keep_slice", "plan_group"]

# ---------------------------------------------------------------------------------- configuration


MeshKind = enum.Enum("MeshKind", "FSDP HSDP HFSDP", module=__name__)
ResidenceKind = enum.Enum("ResidenceKind", "DEVICE HOST OPTIM_STATE", module=__name__)
LayoutKind = enum.Enum("LayoutKind", "CHUNK ROW RAGGED OWNED WHOLE", module=__name__)
ParamsKind = enum.Enum("ParamsKind", "PLAIN TENSOR_PARALLEL SUBCLASS", module=__name__)
CommsKind = enum.Enum("CommsKind", "DBUFFER CUSTOM", module=__name__)
ModelShard = enum.Enum("ModelShard", "PERSISTENT LEAN", module=__name__)
GatherScope = enum.Enum("GatherScope", "UNIT OWN", module=__name__)
ForwardOnly = enum.Enum("ForwardOnly", "NONE TAIL", module=__name__)
ReplicaReduce = enum.Enum("ReplicaReduce", "NOW DEFERRED", module=__name__)
UnshardedStorage = enum.Enum("UnshardedStorage", "FREE KEEP", module=__name__)
GradsTo = enum.Enum("GradsTo", "REACHED EVERY", module=__name__)


@dataclass(frozen=True)
class GroupConfig:
    """What decides a group's plan, as plain values (:func:`fsdp.group.configure.config_of`); the
    enums name the choices. ``layout``: ``CHUNK`` is FSDP2's (copied out), ``WHOLE`` ``no_shard``'s;
    ``model_shard``: ``persistent_param_shard``; ``gather_scope``: ``OWN`` for an explicit bucket;
    ``slice_ranks``: ``reshard_after_forward=n``; ``forward_only``: ``TAIL`` if it ends with
    forward-only parameters; ``replica_reduce``, ``unsharded_storage``, ``grads_to``:
    ``set_requires_all_reduce``, ``set_keep_unsharded_storage``,
    ``set_reduce_scatter_unused_params``. Raises ``ValueError`` for what ``fully_shard`` refuses."""

    strategy: Strategy
    dtypes: Dtypes
    requires_grad: bool
    mesh: MeshKind = MeshKind.FSDP
    residence: ResidenceKind = ResidenceKind.DEVICE
    layout: LayoutKind = LayoutKind.CHUNK
    params: ParamsKind = ParamsKind.PLAIN
    comms: CommsKind = CommsKind.DBUFFER
    model_shard: ModelShard = ModelShard.PERSISTENT
    gather_scope: GatherScope = GatherScope.UNIT
    slice_ranks: Optional[int] = None
    forward_only: ForwardOnly = ForwardOnly.NONE
    replica_reduce: ReplicaReduce = ReplicaReduce.NOW
    unsharded_storage: UnshardedStorage = UnshardedStorage.FREE
    grads_to: GradsTo = GradsTo.REACHED

    def __post_init__(self) -> None:
        problem = self._problem()
        if problem:
            raise ValueError(f"GroupConfig: {problem}")

    def _problem(self) -> Optional[str]:
        s, plain = self.strategy, self.params is ParamsKind.PLAIN
        if (s.shard_params and not s.shard_grads) or (s.shard_grads and not s.shard_optim):
            return "shard_params needs shard_grads, which needs shard_optim (ZeRO-3 > 2 > 1 > 0)"
        if (self.layout is LayoutKind.WHOLE) == s.shard_optim:
            return "the WHOLE layout is no_shard's, and only its"
        if self.layout is LayoutKind.OWNED and self.mesh is not MeshKind.FSDP:
            return "Owned() needs a 1-D mesh"
        flat_shard = self.layout in (LayoutKind.ROW, LayoutKind.RAGGED)
        if self.mesh is MeshKind.HFSDP and not (self.residence is ResidenceKind.DEVICE and plain and flat_shard):
            return "HFSDP shards plain parameters in a flat Shard(0) layout, without offload"
        if self.residence is not ResidenceKind.DEVICE and not plain:
            return "offload takes plain parameters only"
        if self.params is ParamsKind.SUBCLASS and self.layout is not LayoutKind.CHUNK:
            return "tensor subclasses are sharded in torch.chunk pieces along dim 0"
        if self.slice_ranks is not None and (self.slice_ranks < 2 or self.mesh is not MeshKind.FSDP):
            return "reshard_after_forward=n keeps a slice for n > 1 on a 1-D mesh only"
        if not self.requires_grad and self.replica_reduce is ReplicaReduce.DEFERRED:
            return "a frozen group has no reduction to defer"
        if not self.requires_grad and self.grads_to is GradsTo.EVERY:
            return "a frozen group has no gradients to give"
        return None


# ---------------------------------------------------------------------------------- buffers


Buf = enum.Enum(
    "Buf", "MAIN MODEL CAST_MAIN UPLOAD UNSHARDED GATHERED SEND SLICE GRAD_IN REDUCE_OUT PARTIAL MAIN_GRAD GRAD_COPY",
    module=__name__,
)
Place = enum.Enum("Place", "SHARD OWNED REPLICATE PARTIAL", module=__name__)
Where = enum.Enum("Where", "DEVICE HOST", module=__name__)
Lifetime = enum.Enum(
    "Lifetime", "RUN NEVER REFRESH_TO_FORWARD GATHER GATHER_TO_RESHARD FORWARD_TO_BACKWARD REDUCTION GRADIENTS DEFERRED",
    module=__name__,
)


@dataclass(frozen=True)
class BufferPlan:
    """One buffer: ``name`` (``CAST_MAIN``: HFSDP's main cast for its replica gather; ``UPLOAD``:
    the offloaded model shard's upload; ``GATHERED``: the chunked layout's gather target; ``SEND``:
    a subclass's pre-all-gather outputs; ``SLICE``: the ``1/n`` post-forward slice, on the
    ``(W/n, n)`` view of the shard mesh; ``GRAD_COPY``: ``param.grad``'s cast copies), ``dtype``
    (None: ``fsdp_pre_all_gather``'s), ``alias_of`` (same object, no own storage) and ``lifetime``:
    ``RUN`` (kept unsharded storage: from its first gather); ``NEVER`` (it lends its layout; gathers
    write elsewhere); ``REFRESH_TO_FORWARD`` (a later gather casts again); ``GRADIENTS`` from a
    reduction after ``zero_grad()`` to the next drop; ``DEFERRED`` until the next all-reduce."""

    name: Buf
    placements: tuple
    dtype: Optional[torch.dtype]
    where: Where
    lifetime: Lifetime
    alias_of: Optional[Buf] = None


# ---------------------------------------------------------------------------------- routes


ModelRefresh = enum.Enum("ModelRefresh", "NONE CAST GATHER_REPLICAS CAST_GATHER_REPLICAS PRE_ALL_GATHER", module=__name__)
Unsharding = enum.Enum("Unsharding", "GATHER_AT_UNSHARD GATHER_AT_REFRESH IS_MODEL UPLOAD_AT_REFRESH", module=__name__)
GatherSource = enum.Enum("GatherSource", "NONE OWN_ROW MAIN MODEL HOST_UPLOAD SEND", module=__name__)
GatherLanding = enum.Enum("GatherLanding", "NONE UNSHARDED GATHERED", module=__name__)
Sharing = enum.Enum("Sharing", "NEVER MAY_SHARE", module=__name__)
AfterForward = enum.Enum("AfterForward", "KEEP FREE KEEP_SLICE", module=__name__)
KeptAfterForward = enum.Enum("KeptAfterForward", "KEEP_ALL FREE_FORWARD_ONLY_TAIL FREE_TAIL_IF_LAST", module=__name__)
BackwardGather = enum.Enum("BackwardGather", "NONE FULL FROM_SLICE", module=__name__)
ReduceCollective = enum.Enum(
    "ReduceCollective", "NONE REDUCE_SCATTER ALL_REDUCE REDUCE_SCATTER_ALL_REDUCE REDUCE_SCATTER_TWICE SHARD_AXIS_ONLY",
    module=__name__,
)
ReduceRoute = enum.Enum("ReduceRoute", "NONE DIRECT TEMPORARY IN_PLACE DEFERRED", module=__name__)
FoldWhen = enum.Enum("FoldWhen", "NONE AT_LAUNCH_IF_FREE AT_FINISH", module=__name__)


@dataclass(frozen=True)
class ReducePlan:
    """The gradients' route. ``collective``: reduce-scatter, all-reduce (unsharded main grads), both
    (HSDP), reduce-scatter on both axes (HFSDP), or the shard axis only (deferred). ``overwrite``
    (first reduction after ``zero_grad()``) / ``accumulate``: ``DIRECT`` into ``MAIN_GRAD``, via
    ``REDUCE_OUT`` or in place in ``GRAD_IN`` then folded, or ``DEFERRED`` into ``PARTIAL``.
    ``fold``: at launch where waiting is free for the host, else at finish; ``into``: ``HOST`` is a
    download; ``grads_to``: which parameters an all-reducing reduction gives gradients."""

    collective: ReduceCollective
    overwrite: ReduceRoute
    accumulate: ReduceRoute
    fold: FoldWhen
    into: Where
    comms: CommsKind = CommsKind.DBUFFER
    grads_to: GradsTo = GradsTo.REACHED


# What each route reads or writes: every buffer a route touches must be planned.
_TOUCHES: dict[enum.Enum, tuple[Buf, ...]] = {
    ModelRefresh.CAST: (Buf.MAIN, Buf.MODEL),
    ModelRefresh.GATHER_REPLICAS: (Buf.MAIN, Buf.MODEL),
    ModelRefresh.CAST_GATHER_REPLICAS: (Buf.MAIN, Buf.CAST_MAIN, Buf.MODEL),
    ModelRefresh.PRE_ALL_GATHER: (Buf.SEND,),
    Unsharding.IS_MODEL: (Buf.MODEL, Buf.UNSHARDED),
    Unsharding.UPLOAD_AT_REFRESH: (Buf.MODEL, Buf.UNSHARDED),
    GatherSource.OWN_ROW: (Buf.MAIN,),
    GatherSource.MAIN: (Buf.MAIN,),
    GatherSource.MODEL: (Buf.MODEL,),
    GatherSource.HOST_UPLOAD: (Buf.MODEL, Buf.UPLOAD),
    GatherSource.SEND: (Buf.SEND,),
    GatherLanding.UNSHARDED: (Buf.UNSHARDED,),
    GatherLanding.GATHERED: (Buf.GATHERED, Buf.UNSHARDED),
    AfterForward.KEEP_SLICE: (Buf.SLICE,),
    BackwardGather.FROM_SLICE: (Buf.SLICE,),
    ReduceRoute.DIRECT: (Buf.GRAD_IN, Buf.MAIN_GRAD),
    ReduceRoute.TEMPORARY: (Buf.GRAD_IN, Buf.REDUCE_OUT, Buf.MAIN_GRAD),
    ReduceRoute.IN_PLACE: (Buf.GRAD_IN, Buf.MAIN_GRAD),
    ReduceRoute.DEFERRED: (Buf.GRAD_IN, Buf.PARTIAL),
}


@dataclass(frozen=True)
class GroupPlan:
    """Everything a group will hold and do, compiled from ``config`` by :func:`plan_group`.

    * ``model_refresh`` after the optimizer: nothing (model shard is main, or gathers cast), a local
      cast (skipped where the step wrote it), HFSDP's replica gather, or ``fsdp_pre_all_gather``.
    * ``unsharding``: gathered at each use (ZeRO-3) or at the refresh (ZeRO-1/2), the model weights
      (``no_shard``), or uploaded at the refresh (offloaded ``no_shard``).
    * ``gather_source`` / ``gather_landing``: what a gather reads, where it lands; ``sharing``:
      whether a ZeRO-3 gather may join the unit's (reading ``shared_source``).
    * ``after_forward`` (resharding unit): keep, free, or keep the ``1/n`` slice;
      ``kept_after_forward`` (keeping unit): all, free the forward-only tail, or free it if last
      (``Owned()``); ``backward_gather``: none, full, or from the slices.
    * ``reduce`` (:class:`ReducePlan`); ``optim_state``: where the optimizer state lives."""

    config: GroupConfig
    buffers: tuple[BufferPlan, ...]
    model_refresh: ModelRefresh
    unsharding: Unsharding
    gather_source: GatherSource
    gather_landing: GatherLanding
    sharing: Sharing
    shared_source: GatherSource
    after_forward: AfterForward
    kept_after_forward: KeptAfterForward
    backward_gather: BackwardGather
    reduce: ReducePlan
    optim_state: Where

    def buffer(self, name: Buf) -> Optional[BufferPlan]:
        return next((b for b in self.buffers if b.name is name), None)

    def names(self) -> frozenset[Buf]:
        return frozenset(b.name for b in self.buffers)

    def touched(self) -> frozenset[Buf]:
        """Every buffer some route of this plan reads or writes."""
        routes = (
            self.model_refresh, self.unsharding, self.gather_source, self.gather_landing, self.shared_source,
            self.after_forward, self.backward_gather, self.reduce.overwrite, self.reduce.accumulate,
        )
        return frozenset(b for r in routes for b in _TOUCHES.get(r, ()))


# ---------------------------------------------------------------------------------- the planner


def _placements(c: GroupConfig) -> dict[str, Optional[tuple[Place, ...]]]:
    """GroupPlacements.for_mesh's (or HFSDP's .outer) tuples, as Place values."""
    P, R, S = Place.PARTIAL, Place.REPLICATE, (Place.OWNED if c.layout is LayoutKind.OWNED else Place.SHARD)
    if c.mesh is MeshKind.HFSDP:
        return dict(sharded=(S, S), replicated=(R, R), partial=(P, P), deferred=(S, P), model=(S, R))
    lead = (R,) if c.mesh is MeshKind.HSDP else ()
    partial = (P,) * (len(lead) + 1)
    return dict(sharded=lead + (S,), replicated=lead + (R,), partial=partial, deferred=partial[:-1] + (S,), model=None)


def plan_group(c: GroupConfig) -> GroupPlan:
    """The plan of a group configured as ``c`` (pure: equal configs give equal plans)."""
    s, d, pl = c.strategy, c.dtypes, _placements(c)
    host, subclass, chunk = c.residence is ResidenceKind.HOST, c.params is ParamsKind.SUBCLASS, c.layout is LayoutKind.CHUNK
    home = Where.HOST if host else Where.DEVICE
    main_pl = pl["sharded"] if s.shard_optim else pl["replicated"]
    keep = c.unsharded_storage is UnshardedStorage.KEEP
    bufs = [BufferPlan(Buf.MAIN, main_pl, d.main, home, Lifetime.NEVER if subclass else Lifetime.RUN)]

    # the weights: main -> model shard -> (gather) -> unsharded
    hfsdp_model = pl["model"]
    model_alias = not subclass and hfsdp_model is None and d.model == d.main
    # BufferWeights._can_cast_into_gather: Owned() placements are no local scatter of the target
    into_row = not (subclass or model_alias or host or hfsdp_model is not None) and s.shard_optim and (
        c.layout is not LayoutKind.OWNED
    )
    lean = not (subclass or model_alias or hfsdp_model is not None) and s.shard_optim and (
        into_row or c.model_shard is ModelShard.LEAN
    )
    may_share = s.shard_params and chunk and c.gather_scope is GatherScope.UNIT and c.comms is CommsKind.DBUFFER
    if subclass:
        refresh = ModelRefresh.PRE_ALL_GATHER
    elif model_alias:
        refresh = ModelRefresh.NONE
        bufs.append(BufferPlan(Buf.MODEL, main_pl, d.main, home, Lifetime.RUN, alias_of=Buf.MAIN))
    elif hfsdp_model is not None:  # rebuilt by a collective: always persistent
        refresh = ModelRefresh.GATHER_REPLICAS if d.model == d.main else ModelRefresh.CAST_GATHER_REPLICAS
        bufs.append(BufferPlan(Buf.MODEL, hfsdp_model, d.model, Where.DEVICE, Lifetime.RUN))
        if d.model != d.main:
            bufs.append(BufferPlan(Buf.CAST_MAIN, main_pl, d.model, Where.DEVICE, Lifetime.RUN))
    else:
        refresh = ModelRefresh.NONE if lean else ModelRefresh.CAST
        if lean:  # cast before a gather that reads it; a gather into its own target casts into the row
            life = Lifetime.GATHER if not into_row or may_share else Lifetime.NEVER
        elif not s.shard_optim or host:
            life = Lifetime.RUN
        else:  # freed after each forward with grad; ZeRO-1/2's once the refresh's gather landed
            life = Lifetime.REFRESH_TO_FORWARD if s.shard_params else Lifetime.GATHER
        bufs.append(BufferPlan(Buf.MODEL, main_pl, d.model, home, life))

    if not s.shard_optim:
        unsharding = Unsharding.UPLOAD_AT_REFRESH if host else Unsharding.IS_MODEL
    else:
        unsharding = Unsharding.GATHER_AT_UNSHARD if s.shard_params else Unsharding.GATHER_AT_REFRESH
    view_dtype = None if subclass else d.model
    if unsharding is Unsharding.IS_MODEL:
        model = next(b for b in bufs if b.name is Buf.MODEL)
        target = model.alias_of or Buf.MODEL
        bufs.append(BufferPlan(Buf.UNSHARDED, model.placements, model.dtype, model.where, model.lifetime, target))
    else:
        life = Lifetime.GATHER_TO_RESHARD if s.shard_params and not keep else Lifetime.RUN
        bufs.append(BufferPlan(Buf.UNSHARDED, pl["replicated"], view_dtype, Where.DEVICE, life))
    if chunk:  # a subclass's gathered outputs are copied out and freed, kept storage or not
        life = Lifetime.RUN if keep and not subclass else Lifetime.GATHER
        bufs.append(BufferPlan(Buf.GATHERED, pl["replicated"], view_dtype, Where.DEVICE, life))
    if subclass:
        bufs.append(BufferPlan(Buf.SEND, pl["sharded"], None, Where.DEVICE, Lifetime.RUN))
    if host and s.shard_optim:
        bufs.append(BufferPlan(Buf.UPLOAD, main_pl, d.model, Where.DEVICE, Lifetime.GATHER))

    source = shared = landing = None
    if unsharding in (Unsharding.GATHER_AT_UNSHARD, Unsharding.GATHER_AT_REFRESH):
        # a shared gather reads the model shard: only a gather into its own target casts into the row
        if subclass:
            shared = GatherSource.SEND
        elif host:
            shared = GatherSource.HOST_UPLOAD
        else:
            shared = GatherSource.MAIN if model_alias else GatherSource.MODEL
        source = GatherSource.OWN_ROW if into_row else shared
        landing = GatherLanding.GATHERED if chunk else GatherLanding.UNSHARDED

    slice_kept = c.slice_ranks is not None and can_keep_slice(c)  # after forward, and the backward's gather
    if slice_kept:
        slice_pl = (Place.REPLICATE, Place.SHARD)
        bufs.append(BufferPlan(Buf.SLICE, slice_pl, d.model, Where.DEVICE, Lifetime.FORWARD_TO_BACKWARD))
    if not s.shard_params:
        after, backward = AfterForward.KEEP, BackwardGather.NONE
    else:
        after = AfterForward.KEEP_SLICE if slice_kept else AfterForward.FREE
        backward = BackwardGather.FROM_SLICE if slice_kept else BackwardGather.FULL
    kept = KeptAfterForward.KEEP_ALL
    if c.forward_only is ForwardOnly.TAIL and s.shard_params and c.params is ParamsKind.PLAIN and not keep:
        # the storage shrinks to the bytes before the tail: in an Owned() layout, where its owner puts it
        owned = c.layout is LayoutKind.OWNED
        kept = KeptAfterForward.FREE_TAIL_IF_LAST if owned else KeptAfterForward.FREE_FORWARD_ONLY_TAIL

    reduce = _plan_reduce(c, pl, main_pl, home, bufs)
    return GroupPlan(
        config=c, buffers=tuple(bufs), model_refresh=refresh, unsharding=unsharding,
        gather_source=source or GatherSource.NONE, gather_landing=landing or GatherLanding.NONE,
        sharing=Sharing.MAY_SHARE if may_share else Sharing.NEVER,
        shared_source=shared if may_share and shared else GatherSource.NONE,
        after_forward=after, kept_after_forward=kept,
        backward_gather=backward, reduce=reduce,
        optim_state=Where.DEVICE if c.residence is ResidenceKind.DEVICE else Where.HOST,
    )


def can_keep_slice(c: GroupConfig) -> bool:
    """Whether ``reshard_after_forward=n`` may keep a slice (:mod:`fsdp.compose.post_forward`):
    ZeRO-3 plain parameters on a 1-D mesh without offload, not ``Owned()`` (whole tensors on one
    rank cut into no ``Shard(0)`` slice). Others reshard fully and gather all ranks in backward."""
    return (
        c.params is ParamsKind.PLAIN and c.strategy.shard_params and c.mesh is MeshKind.FSDP
        and c.residence is not ResidenceKind.HOST and c.layout is not LayoutKind.OWNED
    )


def _plan_reduce(c: GroupConfig, pl: dict, main_pl: tuple, home: Where, bufs: list[BufferPlan]) -> ReducePlan:
    """``GradReducer``'s buffers (appended to ``bufs``) and its route (``launch_reduce``)."""
    s, d = c.strategy, c.dtypes
    if not c.requires_grad:
        return ReducePlan(ReduceCollective.NONE, ReduceRoute.NONE, ReduceRoute.NONE, FoldWhen.NONE, Where.DEVICE, c.comms)
    grad_pl = pl["sharded"] if s.shard_grads else pl["replicated"]
    bufs.append(BufferPlan(Buf.GRAD_IN, pl["partial"], d.reduce, Where.DEVICE, Lifetime.REDUCTION))
    bufs.append(BufferPlan(Buf.MAIN_GRAD, grad_pl, d.main_grad, home, Lifetime.GRADIENTS))
    if d.main_grad != d.main:
        bufs.append(BufferPlan(Buf.GRAD_COPY, main_pl, d.main, home, Lifetime.GRADIENTS))
    if c.mesh is not MeshKind.FSDP and s.shard_grads and c.replica_reduce is ReplicaReduce.DEFERRED:
        bufs.append(BufferPlan(Buf.PARTIAL, pl["deferred"], d.reduce, Where.DEVICE, Lifetime.DEFERRED))
        deferred = ReduceRoute.DEFERRED
        return ReducePlan(ReduceCollective.SHARD_AXIS_ONLY, deferred, deferred, FoldWhen.NONE, home, c.comms, c.grads_to)
    if not s.shard_grads:
        collective = ReduceCollective.ALL_REDUCE
    elif c.mesh is MeshKind.FSDP:
        collective = ReduceCollective.REDUCE_SCATTER
    else:
        collective = ReduceCollective.REDUCE_SCATTER_ALL_REDUCE if c.mesh is MeshKind.HSDP else ReduceCollective.REDUCE_SCATTER_TWICE
    folded = ReduceRoute.TEMPORARY if s.shard_grads else ReduceRoute.IN_PLACE
    overwrite = ReduceRoute.DIRECT if d.reduce == d.main_grad and home is Where.DEVICE else folded
    fold = FoldWhen.NONE
    if s.shard_grads:  # every accumulation goes through the temporary
        bufs.append(BufferPlan(Buf.REDUCE_OUT, grad_pl, d.reduce, Where.DEVICE, Lifetime.REDUCTION))
        free = home is Where.DEVICE and c.comms is CommsKind.DBUFFER
        fold = FoldWhen.AT_LAUNCH_IF_FREE if free else FoldWhen.AT_FINISH
    return ReducePlan(collective, overwrite, folded, fold, home, c.comms, c.grads_to)
