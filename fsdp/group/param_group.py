"""ParameterGroup: one communication bucket of a unit's parameters, and the parts that hold it.

A group's parameters share dtype, ``requires_grad``, mesh, strategy and shard placement
(:mod:`fsdp.group.bucket`); on a 2-D (HSDP) mesh gathers stay inside a shard group, and one
``redistribute`` reduce-scatters inside it and all-reduces across replicas. ``fully_shard`` hands in
the parts (:mod:`fsdp.group.parts`); the group compiles its ``plan`` (:mod:`fsdp.group.plan`) for
them. The registered parameters are DTensor views of ``main``, the weights the optimizer updates.
``module.to``, ``to_empty``: :mod:`fsdp.group.convert`, :mod:`fsdp.group.meta_init`.
"""

from __future__ import annotations

import weakref
from dataclasses import replace
from typing import Callable, Optional, Union, cast

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import Placement

from dbuffer import CallLabel, DBuffer
from fsdp.group.comms import DBUFFER_COMMS
from fsdp.group.configure import config_of
from fsdp.group.forward_only import ForwardOnlyTail
from fsdp.group.grad_parts import grad_parts
from fsdp.group.grads import GradReducer
from fsdp.group.layouts import PLAIN, ChunkedLayout, FlatLayout, ParamKind, flat_layout
from fsdp.group.members import GroupPlacements, ParamInfo
from fsdp.group.parts import Comms, Weights, WeightsParts
from fsdp.group.plan import GroupPlan, plan_group
from fsdp.group.policy import Dtypes, MixedPrecisionPolicy, Strategy
from fsdp.group.reduction import ReduceSettings
from fsdp.group.registration import Registrations
from fsdp.group.residence import NO_OFFLOAD, Residence
from fsdp.group.siblings import Siblings, place_main
from fsdp.group.streams import CommStreams
from fsdp.group.unsharder import Unsharder
from fsdp.group.weights import BufferWeights

__all__ = ["ParameterGroup"]


class ParameterGroup:
    """The parts of one (dtype, requires_grad) bucket (module docstring), built by ``fully_shard``,
    which checked every argument before any collective. Errors raise from its unsharder (a meta
    group's gather, a replaced parameter: ``RuntimeError``) and :meth:`set_reduction`."""

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
        weights: Callable[[WeightsParts], Weights] = BufferWeights,
        own_gather: bool = False,
        forward_only: Optional[ForwardOnlyTail] = None,
    ) -> None:
        """``infos``: the parameters and their registrations, in registration order (every rank
        packs the same bytes); ``strategy``: the ZeRO stage (:class:`~fsdp.group.policy.Strategy`);
        ``shard``: ``Shard(0)`` or ``dbuffer.Owned()`` (flat layouts); ``gradient_divide_factor``:
        divides the summed gradients instead of the mesh size; ``policy``: the one ``dtypes`` came
        from (``module.to(dtype)`` keeps those it set); ``offload``: default none; ``layout``:
        default :func:`~fsdp.group.layouts.flat_layout`; ``kind``: plain or tensor-parallel;
        ``placements``: default :meth:`GroupPlacements.for_mesh` (HFSDP passes its own);
        ``weights``: builds the weights part; ``own_gather``: share no all-gather with other groups
        (explicit buckets); ``forward_only``: the tail of ``infos`` only forward reads."""
        self.infos = infos
        self.call_label = CallLabel(f"fsdp parameter group {self.names()}")  # its collectives' (lazy init names the unit)
        self.mesh = mesh
        self.strategy = strategy
        self.dtypes = dtypes
        self.policy = policy
        self.requires_grad = requires_grad
        self.kind = kind
        self.own_gather = own_gather
        self.comms: Comms = DBUFFER_COMMS  # FSDP2's custom comm objects replace it (fsdp.compose.custom_comm)
        self.reduction = ReduceSettings(divide_factor=gradient_divide_factor)
        op = self.reduction.op  # the gradient buffer's Partial placements
        self.placements = placements.with_reduce_op(op) if placements else GroupPlacements.for_mesh(mesh.ndim, shard, op)
        self.offload: Residence = offload if offload is not None else NO_OFFLOAD
        tensors = [kind.local(i.param) for i in infos]
        self.layout = layout if layout is not None else flat_layout([tuple(t.shape) for t in tensors], mesh, strategy.shard_optim, shard)
        main_pl = self.placements.sharded if strategy.shard_optim else self.placements.replicated
        buffer_shapes, buffer_layout = self.layout.buffer_shapes()
        device = tensors[0].device  # meta: built under torch.device("meta"), so are the shards (FSDP2)
        self.place_main(main_pl, buffer_shapes, dtypes.main, buffer_layout, device)
        self.sharded_params: list[nn.Parameter] = []
        self.weights: Weights = weights(WeightsParts(infos, mesh, strategy, self.placements, self.layout, kind, self.offload,
                                                     policy, requires_grad, self.sharded_params, self.names()))
        self.plan: GroupPlan = plan_group(config_of(self))
        self.build_weights()
        if not self.is_meta:
            self.weights.fill(tensors)
        self.sharded_params += self.new_sharded_params()
        self.initialising = False  # inside init_weights (fsdp.group.meta_init)
        self.unsharder = Unsharder(self.weights, Registrations(infos), self.sharded_params, self.comms,
                                   self.placements.replicated, self.streams, self.plan, self.call_label, self.names(), forward_only)
        self.grads: Optional[GradReducer] = GradReducer(
            grad_parts(self), self.placements, dtypes, self.reduction, self.plan.reduce, self.comms) if requires_grad else None
        self.unsharder.refresh()

    def replan(self) -> None:
        """Recompile the plan after its inputs changed, between steps; hand the parts its routes."""
        post = self.unsharder.post_forward
        self.plan = plan_group(config_of(self, post.ranks if post is not None else None))
        self.weights.replanned(self.plan)
        self.unsharder.replanned(self.plan, self.comms)
        if self.grads is not None:
            self.grads.replanned(self.plan.reduce, self.comms, self.reduction)

    def set_reduction(self, **changes: object) -> None:
        """Change ``reduction`` fields between steps (groups requiring grad) and replan. Raises
        ``RuntimeError``, changing nothing, for a new reduce op while gradients await reduction."""
        new, grads = replace(self.reduction, **changes), cast(GradReducer, self.grads)
        if new.op != self.reduction.op:
            if grads.busy():
                raise RuntimeError(
                    f"cannot change how gradients of {self.names()} are reduced while some wait to be "
                    f"reduced; change it before the backward (or after finish_grad_sync())"
                )
            self.placements = self.placements.with_reduce_op(new.op)
            grads.reduce_op_changed(self.placements)
        self.reduction = new
        self.replan()

    def build_weights(self) -> None:
        """(Re)build the weights part for the current main weights, dtypes and plan."""
        self.weights.build(self.plan, self.main, self.dtypes, Siblings.of(self.main, self.compute_device, self.offload))

    def new_sharded_params(self) -> list[nn.Parameter]:
        """The weights part's sharded parameters, naming this group to :mod:`fsdp.optim.step_hooks`."""
        params = self.weights.new_sharded_params()
        for p in params:
            p._fsdp_group = weakref.ref(self)
        return params

    def place_main(self, placements, shapes, dtype: torch.dtype, layout, device: torch.device) -> None:
        """Allocate ``main`` (:func:`~fsdp.group.siblings.place_main`); the streams follow its compute device."""
        self.main, self.compute_device = place_main(self.mesh, placements, shapes, dtype, layout, device, self.offload)
        self.streams = CommStreams.for_device(self.compute_device)

    @property
    def is_meta(self) -> bool:
        """Built under ``torch.device("meta")`` and not yet given storage (``to_empty``)."""
        return self.main.device.type == "meta"

    def sibling(self, placements, dtype: torch.dtype, zero_fill: bool = True) -> DBuffer:
        """A sibling of ``main`` (same shapes and layout) on the compute device."""
        return self.main.sibling(placements, dtype, self.compute_device, zero_fill=zero_fill)

    def sharded_views(self, buf: DBuffer) -> list[torch.Tensor]:
        """The DTensor view of every parameter in a buffer at the sharded placements."""
        return self.layout.views(buf, self.kind, tuple(self.placements.sharded[:-1]))

    @property
    def unsharded_params(self) -> Optional[list[nn.Parameter]]:
        """What the modules compute with while gathered (:class:`~fsdp.group.unsharder.Unsharder`)."""
        return self.weights.unsharded_params

    def names(self) -> str:
        """The group's first parameter names, for error messages."""
        return ", ".join(repr(i.fqn) for i in self.infos[:3]) + (", ..." if len(self.infos) > 3 else "")
