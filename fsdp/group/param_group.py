"""ParameterGroup: one communication bucket of a unit's parameters, as a set of DBuffers.

A group's parameters share a dtype, ``requires_grad``, a mesh, a sharding strategy and a shard
placement (see :mod:`fsdp.group.bucket`). On a 1-D mesh the shard axis is the mesh; on a 2-D mesh
(HSDP) the outer axis replicates and the inner one shards, so gathers stay inside a shard group
and one ``redistribute`` reduce-scatters inside it and all-reduces across replicas.

Buffers, all on one layout (parameter registration order, so every rank packs the same bytes):

* ``main``: the weights the optimizer updates; sharded unless ``no_shard``. The registered
  parameters are DTensor views of it, so a plain torch optimizer works on them unchanged.
* ``model``: the compute-dtype copy at the placement of ``main``. When dtype and placement match
  it *is* ``main`` (no copy, no per-step cast); otherwise it is refreshed by ``cast(out=)`` after
  the optimizer step, never through a full-size temporary.
* ``unsharded``: the full compute weights forward/backward read. ``optim_grads_params`` gathers
  it before use and releases its storage after; the other strategies keep it (for ``no_shard``
  with matching dtype it is ``main`` itself).
* ``gathered``: with FSDP2's chunked layout only, where an all-gather lands before the pieces
  are copied out into ``unsharded``; storage only while a gather lands.
* ``grads.grad_in`` / ``grads.main_grad``: the gradient buffers of the group's
  :class:`~fsdp.group.grads.GradReducer` (where this rank's unsharded gradients land; the reduced
  ones, which ``param.grad`` and ``param.main_grad`` are views of).

Where each parameter sits in these buffers, and which copies a collective needs, is the group's
layout (:mod:`fsdp.group.layouts`).
"""

from __future__ import annotations

import weakref
from typing import Optional, Union

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import Placement


from dbuffer import DBuffer, Pending
from fsdp.group.comms import DBUFFER_COMMS
from fsdp.group.convert import DtypeConversion
from fsdp.group.grads import GradReducer
from fsdp.group.members import GroupPlacements, ParamInfo, check_no_late_extension
from fsdp.group.layouts import PLAIN, ChunkedLayout, FlatLayout, ParamKind, flat_layout
from fsdp.group.meta_init import MetaInit, meta_error
from fsdp.group.registration import note_registration
from fsdp.group.residence import NO_OFFLOAD
from fsdp.group.profiling import label
from fsdp.group.policy import Dtypes, MixedPrecisionPolicy, Strategy
from fsdp.group.reduction import ReduceSettings
from fsdp.group.streams import CommStreams

__all__ = ["ParameterGroup"]


class ParameterGroup(MetaInit, DtypeConversion):
    """The DBuffers of one (dtype, requires_grad) group and the moves between them. It *has* a
    layout (:mod:`fsdp.group.layouts`: where each parameter sits in the buffers, what is copied
    around a collective), a parameter kind (plain, or tensor-parallel DTensors), and optional
    parts that plug in from :mod:`fsdp.compose` (``offload``, ``comms``, ``post_forward``)."""

    # The parameters fsdp last registered on the modules (None: not yet, the originals are there).
    _registered: Optional[list[nn.Parameter]] = None
    # reshard_after_forward=n: the 1/n slice kept between forward and backward (fsdp.compose.post_forward).
    post_forward: Optional[object] = None
    # weights_version() when fsdp.optim last wrote the model shard with the main weights.
    _written_version: Optional[int] = None
    # The all-gather's target when the layout copies out of it (else gathers land in ``unsharded``).
    gathered: Optional[DBuffer] = None
    # Whether reshard_after_forward=n may keep a slice of this group (subclasses that gather
    # something else than the model shard say no).
    keeps_post_forward_slice = True

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
        offload: Optional[object] = None,
        layout: Optional[Union[FlatLayout, ChunkedLayout]] = None,
        kind: ParamKind = PLAIN,
    ) -> None:
        """``shard``: ``Shard(0)`` (row-atomic packing) or ``dbuffer.Owned()`` (whole tensors on
        balanced owners) for the flat layouts. ``gradient_divide_factor``: divide the summed
        gradients by this instead of averaging over the mesh (e.g. expert weights, whose
        gradients already hold the contributions of a whole expert-parallel group). ``policy``:
        the policy ``dtypes`` came from; :meth:`convert` keeps the dtypes it set explicitly (None:
        every dtype follows). ``offload``: a host-offload part (:mod:`fsdp.compose.offload`)
        keeping the main weights, main grads and optimizer state on the host; compute buffers
        live on the mesh's device. ``layout``: default :func:`~fsdp.group.layouts.flat_layout`.
        ``kind``: how parameters are wrapped (:class:`~fsdp.group.layouts.ParamKind`)."""
        self.infos = infos
        self.mesh = mesh
        self.strategy = strategy
        self.dtypes = dtypes
        self.policy = policy
        self.requires_grad = requires_grad
        self.kind = kind
        self.comms = DBUFFER_COMMS  # FSDP2's custom comm objects replace it (fsdp.compose.custom_comm)
        self.reduction = ReduceSettings(divide_factor=gradient_divide_factor)  # FSDP2's reduction knobs
        self.placements = self._group_placements(shard, self.reduction.op)
        tensors = [kind.local(i.param) for i in infos]
        device = tensors[0].device
        meta = device.type == "meta"  # built on meta: so are the shards, until to_empty (FSDP2)
        shapes = [tuple(t.shape) for t in tensors]
        pl = self.placements
        main_pl = pl.sharded if strategy.shard_optim else pl.replicated
        self.layout = layout if layout is not None else flat_layout(shapes, mesh, strategy.shard_optim, shard)
        buffer_shapes, buffer_layout = self.layout.buffer_shapes()
        self.offload = offload if offload is not None else NO_OFFLOAD
        self._place_main(main_pl, buffer_shapes, dtypes.main, buffer_layout, device)  # meta: until to_empty
        if not meta:
            self._fill_main(tensors)
        self._build_compute_buffers()
        self.sharded_params = self._new_sharded_params()
        self._stale = True  # the main weights changed since the last refresh
        self._weights_version: Optional[int] = None  # weights_version() at the last refresh
        self._refreshes = 0
        self._gathered: Optional[int] = None  # refresh the unsharded storage holds, if any
        self._gather_pending: Optional[Pending] = None
        self.refresh()
        self.grads: Optional[GradReducer] = GradReducer(self) if requires_grad else None
        self._init_buffer: Optional[DBuffer] = None  # full main-dtype weights during init_weights

    def _group_placements(self, shard: Placement, reduce_op: str) -> GroupPlacements:
        """The placements of this group's buffers on its mesh (a subclass may nest the axes
        differently: :mod:`fsdp.compose.outer_shard`)."""
        return GroupPlacements.for_mesh(self.mesh.ndim, shard, reduce_op)

    def _place_main(self, placements, shapes, dtype: torch.dtype, layout, device: torch.device) -> None:
        """Allocate ``main`` on ``device`` (meta for a meta-built group, else this rank's device),
        or on the host under offload; the compute device and the streams follow. fully_shard
        checked that every rank builds the same unit, so no rank check here."""
        if not self.offload.on_host or device.type == "meta":
            self.main = DBuffer(self.mesh, placements, shapes, dtype, device, layout=layout, check_ranks=False)
            self.compute_device = self.main.device
        else:
            self.main = self.offload.buffer(self.mesh, placements, shapes, dtype, layout)
            self.compute_device = self.offload.compute_device
        self.streams = CommStreams.for_device(self.compute_device)

    def _build_compute_buffers(self) -> None:
        """``model``, ``unsharded`` and the unsharded parameters (views of it) for ``main`` and
        ``dtypes``; with a layout that copies, also ``gathered``, the all-gather's target (storage
        only while a gather lands). Their values come from the next :meth:`refresh` / :meth:`unshard`."""
        d, strategy = self.dtypes, self.strategy
        self.model = self.main if d.model == d.main else self._host(self.main.placements, d.model)
        self._release_lean_model()
        self.gathered = None
        if self.layout.copies:
            self.gathered = self._new(self.placements.replicated, d.model, zero_fill=False)
            self.gathered.release_storage()
        if not strategy.shard_optim and not self.offload.on_host and not self.layout.copies:
            self.unsharded = self.model  # no_shard: the replicated model weights are the full ones
        else:
            self.unsharded = self.layout.unsharded_buffer(
                self.main, self.placements.replicated, d.model, self.compute_device, zero_fill=not strategy.shard_params
            )
        self.unsharded_params = [self._module_param(k, self.unsharded.get_local_tensor(k)) for k in range(len(self.infos))]
        if strategy.shard_params:  # gathered before each use (its views exist now)
            self.unsharded.release_storage()
        if self.post_forward is not None:  # rebuilt (module.to, to_empty): follow the new buffer
            self.post_forward = self.post_forward.rebuilt(self._gathered_buffer())

    def _deferred_placements(self, target_pl: tuple) -> tuple:
        """Where reduce-scattered sums wait while HSDP's all-reduce across replicas is deferred:
        sharded on the shard axis (the last), still partial on the replicate axis."""
        return self.placements.partial[:-1] + target_pl[-1:]

    def _module_param(self, k: int, full: torch.Tensor) -> nn.Parameter:
        """What modules compute with for parameter ``k`` whose whole values are ``full`` (a view
        of a buffer): the view itself for plain parameters; a DTensor on the parameter's
        tensor-parallel mesh around it for the tensor-parallel kind."""
        return self.kind.unsharded(k, full, self.requires_grad)

    def _sharded_views(self, buf: DBuffer) -> list[torch.Tensor]:
        """The DTensor view of every parameter in a buffer at the sharded placements."""
        return self.layout.views(buf, self.kind, tuple(self.placements.sharded[:-1]))

    @property
    def lean_model(self) -> bool:
        """Whether the model shard is a temporary cast before each gather (the policy's
        ``persistent_param_shard=False``) rather than a copy kept between steps."""
        return (
            self.policy is not None
            and not self.policy.persistent_param_shard
            and self.model is not self.main
            and self.strategy.shard_optim
        )

    @property
    def step_writes_model(self) -> bool:
        """Whether :mod:`fsdp.optim` may write the model shard in its step: a persistent copy
        at ``main``'s placements (same local ranges), not ``main`` itself."""
        return self.model is not self.main and not self.lean_model

    def _release_lean_model(self) -> None:
        if self.lean_model:
            self.model.release_storage()

    def _cast_model(self) -> None:
        """Cast the main shard into the model shard (allocated first if released)."""
        if self.model.is_storage_released():
            self.model.reallocate_storage()
        self.main.cast(self.dtypes.model, out=self.model)

    def _model_released(self) -> bool:
        return self.model is not self.main and self.model.is_storage_released()

    def release_model_shard(self) -> None:
        """The unsharded weights stay gathered from now until the main weights change (a unit
        that keeps them after forward, e.g. the root; ZeRO-1/2 after their gather): nothing reads
        the persistent model shard before the optimizer writes it again, so its storage goes now
        (``shard numel x param_dtype size``, alive at the backward peak otherwise). Should a
        gather come first after all (``reshard()``, micro-batches), it casts the shard again from
        the main weights: the same values, as ``persistent_param_shard=False`` does every time."""
        model = self.model
        if model is None or model is self.main or self.offload.on_host or not self.strategy.shard_optim:
            return
        if not model.is_storage_released():
            model.release_storage()

    def _new_sharded_params(self) -> list[nn.Parameter]:
        params = [nn.Parameter(t, requires_grad=self.requires_grad) for t in self._sharded_views(self.main)]
        for p in params:
            p._fsdp_group = weakref.ref(self)  # found by the optimizer-step hook (fsdp.optim.step_hooks)
        return params

    def _new(self, placements, dtype: torch.dtype, zero_fill: bool = True, device=None) -> DBuffer:
        """A sibling of ``main`` on the compute device (or ``device``)."""
        return DBuffer(
            self.mesh,
            placements,
            self.main.shapes,
            dtype,
            self.compute_device if device is None else device,
            layout=self.main.layout,
            zero_fill=zero_fill,
            check_ranks=False,  # a sibling of main
        )

    def _host(self, placements, dtype: torch.dtype, zero_fill: bool = True) -> DBuffer:
        """A sibling of ``main`` where ``main`` lives: on the host (pinned) under offload."""
        if not self.offload.on_host or self.is_meta:
            return self._new(placements, dtype, zero_fill)
        return self.offload.buffer(self.mesh, placements, self.main.shapes, dtype, self.main.layout, zero_fill)

    def _gather_source(self) -> DBuffer:
        """The sharded compute weights a gather reads: ``model``, or under offload its copy on
        the compute device (uploaded now, on the current stream: the gather's)."""
        return self.offload.upload(self.model)

    def _settle(self) -> None:
        """Wait for the host copies in flight (offload) before the host touches their buffers."""
        self.offload.settle()

    @torch.no_grad()
    def _fill_main(self, tensors: list[torch.Tensor]) -> None:
        """Copy this rank's part of every (identically initialised) full tensor into ``main``."""
        self.layout.fill(self.main, tensors)

    # ------------------------------------------------------------------ weights

    def weights_version(self) -> int:
        """Changes when an in-place op autograd sees updates a parameter (``load_state_dict``,
        a for-loop optimizer). Foreach ops on DTensors do not bump it, hence also :meth:`mark_stale`,
        called after every ``torch.optim`` optimizer step."""
        return sum(p._version for p in self.sharded_params) + self.main.local_buffer._version

    def mark_stale(self, model_written: bool = False) -> None:
        """The main weights changed: refresh the model weights before the next use.
        ``model_written``: the caller also wrote the model shard from them (:mod:`fsdp.optim`
        does, in the optimizer's pass), so the refresh skips the cast unless the weights change
        again before it."""
        self._stale = True
        self._written_version = self.weights_version() if model_written else None

    @torch.no_grad()
    def refresh(self) -> None:
        """Bring the model weights up to date with the main weights, if they changed.

        Sharded strategies cast only this rank's shard; the persistent unsharded weights of
        ``optim``/``optim_grads`` are then all-gathered from it. ``optim_grads_params`` gathers
        at the next :meth:`unshard` instead.
        """
        check_no_late_extension(self)
        version = self.weights_version()
        if not self._stale and version == self._weights_version:
            return
        if self.is_meta:  # nothing to cast or gather until to_empty
            return
        with label("fsdp::optimizer_refresh"):
            self._refresh_model(version)
        self._weights_version = version
        self._stale = False
        self._refreshes += 1

    def _refresh_model(self, version: int) -> None:
        """Cast the main shard into the model shard (unless the optimizer wrote it already) and,
        for ``optim``/``optim_grads``, gather it into the persistent unsharded weights."""
        self._settle()  # an upload may still read model
        lean = self.lean_model
        if self.model is not self.main and version != self._written_version and not lean:
            self._cast_model()
        self._written_version = None
        if self.strategy.shard_optim and not self.strategy.shard_params:
            if lean:
                self._cast_model()
            self.all_gather(self._gather_source(), self._gather_target()).wait()
            self._end_gather()
            self.release_model_shard()  # gathered until the next step: read again only after it
            self.offload.release_upload()
        elif self.offload.on_host and not self.strategy.shard_optim:
            self.offload.upload(self.model, out=self.unsharded)  # no_shard: nothing to gather

    def unshard(self, async_op: bool = False) -> None:
        """Make the unsharded weights current: all-gather (ZeRO-3) into the reused buffer."""
        if self.is_meta:
            raise RuntimeError(meta_error([i.fqn for i in self.infos]))
        if self._gather_pending is not None:  # prefetched: its source was refreshed at launch
            if not async_op:
                self.wait_unshard()
            return
        self.refresh()
        if not self.strategy.shard_params:
            return
        if self._gathered == self._refreshes and not self.unsharded.is_storage_released():
            return
        self._version_before_gather = self.unsharded.local_buffer._version
        post = self.post_forward
        if post is not None and post.holds is not None:
            if post.holds == self._refreshes:  # backward after reshard_after_forward=n: gather in n ranks
                self._gather_target()  # with storage: where post.gather() lands
                with self.streams.launch(self.streams.all_gather):
                    self._gather_pending = post.gather()
                if not async_op:
                    self.wait_unshard()
                return
            post.drop()  # the weights changed since
        target = self._gather_target()
        if self.lean_model or self._model_released():
            self._cast_model()
        with self.streams.launch(self.streams.all_gather):
            self._gather_pending = self.all_gather(self._gather_source(), target)
        if not async_op:
            self.wait_unshard()

    def all_gather(self, source: DBuffer, target: DBuffer) -> Pending:
        """Gather ``source`` (sharded) into ``target`` (replicated), in flight, by the group's
        comms (dbuffer's, or FSDP2's comm objects: :mod:`fsdp.compose.custom_comm`)."""
        with label("fsdp::all_gather"):
            return self.comms.all_gather(source, self.placements.replicated, target)

    def reduce_into(self, source: DBuffer, placements: tuple, out: DBuffer, async_op: bool = True):
        """``source.redistribute(placements, out=out)`` by the group's comms: a reduce-scatter on
        the shard axis (and an HSDP all-reduce across replicas), or an all-reduce."""
        with label("fsdp::reduce_scatter"):
            return self.comms.reduce(source, placements, out, async_op)

    def _gather_target(self) -> DBuffer:
        """Where the all-gather of the model weights lands, given its storage: the gathered
        buffer if the layout copies out of it, else the unsharded weights themselves."""
        target = self._gathered_buffer()
        target.reallocate_storage()
        return target

    def _gathered_buffer(self) -> DBuffer:
        """The buffer an all-gather of the weights fills."""
        return self.unsharded if self.gathered is None else self.gathered

    @torch.no_grad()
    def _end_gather(self) -> None:
        """After the gather has landed: a layout that copies moves the gathered pieces into the
        unsharded parameters, which get their storage only now (as FSDP2's copy-out allocates
        them: a gather in flight, a prefetch, holds the gathered buffer alone, not both)."""
        if self.gathered is None:
            return
        with label("fsdp::copy_out"):
            self.unsharded.reallocate_storage()
            self.layout.copy_out(self.gathered, self.unsharded)
            self.gathered.release_storage()

    def wait_unshard(self) -> None:
        if self._gather_pending is not None:
            self._gather_pending.wait()
            self.streams.wait(self.streams.all_gather)
            self._gather_pending = None
            self._release_lean_model()
            self.offload.release_upload()
            self._end_gather()
            if self.post_forward is not None:
                self.post_forward.drop()
            self._gathered = self._refreshes
            # A regather restores values autograd saved in forward; it is not a modification.
            # (DBuffer's refill guard covers the launch; this also covers work done in wait().)
            torch._C._autograd._unsafe_set_version_counter(
                (self.unsharded.local_buffer,), (self._version_before_gather,)
            )

    def can_keep_post_forward_slice(self) -> bool:
        """Whether ``reshard_after_forward=n`` may keep a slice of this group: ZeRO-3 plain
        parameters (any layout) on a 1-D mesh without offload (:mod:`fsdp.compose.post_forward`)."""
        return (
            self.keeps_post_forward_slice and self.kind.plain and self.strategy.shard_params
            and self.mesh.ndim == 1 and not self.offload.on_host
        )

    def _keep_post_forward(self, post) -> None:
        """Let ``post`` keep its slice of the gathered weights: copied out of the gathered buffer
        (flat), or rebuilt from the unsharded parameters (a layout that copies has freed it)."""
        if self.gathered is None:
            post.keep(self._gathered)
        else:
            post.keep(self._gathered, fill=lambda out, start, end: self.layout.fill_slice(self.unsharded, out, start, end))

    def reshard_after_forward(self) -> None:
        """After forward: keep this rank's ``1/n`` slice of the gathered weights if
        ``reshard_after_forward=n`` enabled it, then free them as :meth:`reshard` does."""
        post = self.post_forward
        if post is None:  # subclasses' reshard() as they define it
            self.reshard()
            return
        self.wait_unshard()
        if self._gathered is not None and not self.unsharded.is_storage_released():
            self._keep_post_forward(post)
        self.reshard(keep_post_forward=True)

    def reshard(self, keep_post_forward: bool = False) -> None:
        """Free the unsharded weights (ZeRO-3 only: the other strategies keep them)."""
        if not self.strategy.shard_params:
            return
        self.wait_unshard()
        if self.post_forward is not None and not keep_post_forward:
            self.post_forward.drop()
        if not self.unsharded.is_storage_released():
            self.unsharded.release_storage()
        self._gathered = None

    def _names(self) -> str:
        return ", ".join(repr(i.fqn) for i in self.infos[:3]) + (", ..." if len(self.infos) > 3 else "")

    # ------------------------------------------------------------------ registration

    def use_params(self, unsharded: bool) -> None:
        """Register the unsharded (plain) or sharded (DTensor) parameters on their modules; see
        :meth:`check_registered` for when that raises instead (registering nothing)."""
        self._register(self.unsharded_params if unsharded else self.sharded_params)

    def _register(self, params: list[nn.Parameter]) -> None:
        self.check_registered()
        for info, p in zip(self.infos, params):
            for module, name in info.registrations:
                module._parameters[name] = p
        if self._registered is None:  # fully_shard: optimizers are checked again
            note_registration()
        if params is self.unsharded_params and not hasattr(params[0], "_fsdp_unsharded"):
            for p in params:  # found by the optimizer-step pre-hook below
                p._fsdp_unsharded = True
        self._registered = params

    def check_registered(self) -> None:
        """Raise if a module no longer holds the parameter fsdp registered there: one assigned
        after ``fully_shard`` (``module.weight = nn.Parameter(...)``) would otherwise be silently
        replaced by fsdp's own at the next registration, and never trained or used."""
        expected = self._registered
        if expected is None:
            return
        for info, want in zip(self.infos, expected):
            for module, name in info.registrations:
                have = module._parameters.get(name)
                if have is not want:
                    owner = getattr(self.sharded_params[0], "_fsdp_owner", "its fsdp unit")
                    alias = "" if (module, name) == info.registrations[0] else f" (tied; its {type(module).__name__}.{name})"
                    what = "removed" if have is None else "replaced"
                    raise RuntimeError(
                        f"parameter {info.fqn!r} of {owner}{alias} was {what} after fully_shard; fsdp "
                        f"registers its own sharded parameter there and would silently drop yours. Assign "
                        f"parameters before fully_shard, or change the values in place: "
                        f"fsdp.checkpoint.set_state_dict(model, model_state_dict={{name: full_tensor}}, "
                        f"options=StateDictOptions(full_state_dict=True, strict=False)), or "
                        f"fsdp.init_weights(model, fn) with fn copying into the (then full) parameter"
                    )
