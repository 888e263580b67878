"""The rest of FSDP2's surface: ``FSDPModule``'s setters, ``share_comm_ctx``, ``dp_mesh_dims``;
FSDP2's semantics where fsdp has the mechanism, else a documented no-op or a clear error.

The setters become :class:`fsdp.FSDPModule` methods. As in FSDP2 each runs locally, so calling it
on some ranks only cannot hang, but one changing what is communicated must be made on every rank.
Reduce-op settings raise, changing nothing, while gradients wait to be reduced.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Literal, Optional

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from dbuffer import compat, mesh_device
from fsdp.compose import custom_comm
from fsdp.compose.tensor_parallel import DataParallelDims
from fsdp.group.reduction import check_divide_factor
from fsdp.unit.state import FSDPState

if TYPE_CHECKING:
    from fsdp.group.comms import AllGatherComm, ReduceScatterComm
    from fsdp.group.streams import DeviceEvent, DeviceStream

__all__ = ["ArgumentTypeError", "DataParallelMeshDims", "data_parallel_mesh", "share_comm_ctx"]


# FSDP2's class; before torch 2.12 a stand-in whose constructor raises (dbuffer.compat).
DataParallelMeshDims = compat.data_parallel_mesh_dims()


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type: a ``TypeError``, also FSDP2's ``ValueError`` there."""


def _units(module: nn.Module, recurse: bool) -> list["FSDPState"]:
    return module._states(recurse)


def _set_reduction(module: nn.Module, recurse: bool, **changes: object) -> None:
    groups = [g for state in _units(module, recurse) for g in state.groups if g.requires_grad]
    for group in groups:  # every group is checked before any changes
        group.set_reduction(**changes)  # raises, changing nothing, mid-reduction


def set_requires_all_reduce(self: nn.Module, requires_all_reduce: bool, *, recurse: bool = True) -> None:
    """HSDP: False defers the all-reduce across replicas (HFSDP: the reduce-scatter) to the next
    reduction with it on, ``param.grad`` unchanged meanwhile. No effect on 1-D meshes; raises
    ``ValueError`` for a strategy that does not reduce-scatter gradients."""
    if not isinstance(requires_all_reduce, bool):
        raise ArgumentTypeError(f"requires_all_reduce must be a bool, got {requires_all_reduce!r}")
    groups = [g for state in _units(self, recurse) for g in state.groups if g.requires_grad and g.mesh.ndim == 2]
    for group in groups:  # every group is checked before any changes
        if not requires_all_reduce and not group.strategy.shard_grads:
            raise ValueError(
                f"set_requires_all_reduce(False) defers the all-reduce across replicas of reduce-scattered "
                f"gradients; parameters {group.names()} use sharding_strategy {group.strategy.name!r}, whose "
                f"gradients are not reduce-scattered. Use set_requires_gradient_sync(False) instead"
            )
    for group in groups:
        group.set_reduction(all_reduce=requires_all_reduce)


def set_all_reduce_hook(
    self: nn.Module, hook: Callable[[torch.Tensor], None], *, stream: Optional[DeviceStream] = None
) -> None:
    """Call ``hook(reduced)`` on this unit's reduced gradient shard (flat, padded, reduce dtype;
    modify in place) after each reduction (not recursive): the reduce-scatter on 1-D, the
    all-reduce across replicas on HSDP. ``stream`` (1-D only, as FSDP2): run the hook there."""
    if not callable(hook):
        raise ArgumentTypeError(f"hook must be a callable (torch.Tensor) -> None, got {hook!r}")
    groups = [g for g in self._fsdp_state.groups if g.requires_grad]
    if stream is not None and any(g.mesh.ndim == 2 for g in groups):
        raise ValueError("stream cannot be set when using native HSDP")
    for group in groups:
        group.set_reduction(hook=hook, hook_stream=stream)


def set_gradient_divide_factor(self: nn.Module, factor: float) -> None:
    """Divide this unit's summed gradients by ``factor`` instead of averaging them over the
    data-parallel ranks (not recursive); the gradient buffer then reduces with ``sum``."""
    factor = check_divide_factor(factor)
    _set_reduction(self, False, divide_factor=factor)


def set_reduce_scatter_divide_factor(self: nn.Module, factor: float) -> None:
    """Deprecated in FSDP2: :meth:`set_gradient_divide_factor`."""
    set_gradient_divide_factor(self, factor)


def set_force_sum_reduction_for_comms(self: nn.Module, enable: bool) -> None:
    """True: this unit's collectives only sum (not recursive); the division by the divide factor
    runs after them and after the all-reduce hook, as in FSDP2. Same gradients up to rounding."""
    if not isinstance(enable, bool):
        raise ArgumentTypeError(f"enable must be a bool, got {enable!r}")
    _set_reduction(self, False, force_sum=enable)


def set_reduce_scatter_unused_params(
    self: nn.Module, reduce_scatter_unused_params: bool, *, recurse: bool = True
) -> None:
    """Unused parameters always reduce as zeros in their group's collective, so ranks never
    mismatch. True also attaches the reduced gradient to every parameter on every rank (MoE);
    with False ``.grad`` stays None where this rank's backward did not reach, even if others did."""
    if not isinstance(reduce_scatter_unused_params, bool):
        raise ArgumentTypeError(f"reduce_scatter_unused_params must be a bool, got {reduce_scatter_unused_params!r}")
    _set_reduction(self, recurse, unused_params=reduce_scatter_unused_params)


def set_reduce_scatter_max_input_buffers(self: nn.Module, max_input_buffers: int, *, recurse: bool = True) -> None:
    """How many gradient reductions may be in flight in backward (default 1; more overlaps only
    when reductions outlast a unit's backward, each costing an unsharded gradient buffer). Tree-wide
    (:class:`~fsdp.unit.root.RootContext`): the last value set once initialised, else the largest."""
    if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
        raise TypeError(f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}")
    if max_input_buffers < 1:
        raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")
    for state in _units(self, recurse):
        state.root_knobs().max_reductions_in_flight = max_input_buffers


def set_unshard_in_backward(self: nn.Module, unshard_in_backward: bool) -> None:
    """False: this unit's backward does not gather its weights again (not recursive); only for
    units whose backward never reads them (an embedding), else it reads freed storage."""
    if not isinstance(unshard_in_backward, bool):
        raise ArgumentTypeError(f"unshard_in_backward must be a bool, got {unshard_in_backward!r}")
    self._fsdp_state.unshard_in_backward = unshard_in_backward


def set_post_optim_event(self: nn.Module, event: DeviceEvent) -> None:
    """The root's next forward gathers only after ``event`` (recorded after the optimizer step;
    used once). Unlike FSDP2 the gathers still wait for the current stream too: the event only
    adds ordering (:meth:`fsdp.group.streams.CommStreams.gathers_wait`; on CPU the host waits)."""
    if not hasattr(event, "synchronize"):
        raise ArgumentTypeError(f"event must be a torch.Event (or torch.cuda.Event), got {event!r}")
    self._fsdp_state.root_knobs().post_optim_event = event


def reset_iter_state(self: nn.Module) -> None:
    """After a forward or backward raised: call on the root, then train on. See
    :meth:`fsdp.unit.state.FSDPState.reset_iter_state` (the failed iteration's gradients are lost)."""
    self._fsdp_state.reset_iter_state()


def set_custom_all_gather(self: nn.Module, comm: AllGatherComm) -> None:
    """Gather this unit's weights (not recursive) with ``comm``, an object of FSDP2's ``AllGather``
    protocol, on dbuffer's flat buffers (:mod:`fsdp.compose.custom_comm`). Unlike FSDP2, a unit
    with several groups is accepted: ``comm`` is called once per group. Set it on every rank."""
    custom_comm.check_comm(comm, "set_custom_all_gather", "AllGather")
    for group in self._fsdp_state.groups:
        custom_comm.install(group, all_gather_comm=comm)


def set_custom_reduce_scatter(self: nn.Module, comm: ReduceScatterComm) -> None:
    """Reduce-scatter this unit's gradients (not recursive) with ``comm``, an object of FSDP2's
    ``ReduceScatter`` protocol (:mod:`fsdp.compose.custom_comm`). Set it on every rank."""
    custom_comm.check_comm(comm, "set_custom_reduce_scatter", "ReduceScatter")
    for group in self._fsdp_state.groups:
        custom_comm.install(group, reduce_scatter_comm=comm)


def set_separate_reduce_scatter_group(self: nn.Module, enable: bool = True, *, recurse: bool = True) -> None:
    """Accepted, no effect: dbuffer owns the process groups its collectives run on, and fsdp has
    at most one reduction in flight while the next unit's gather runs."""
    if not isinstance(enable, bool):
        raise ArgumentTypeError(f"enable must be a bool, got {enable!r}")


class CustomCommConflictError(ValueError, AssertionError):
    """A comm-memory setter on a unit with a custom comm object: a ``ValueError``, also the
    ``AssertionError`` FSDP2 raises."""


def _comm_memory(self: nn.Module, what: str, kind: str, enable: bool, backend: str = "NCCL") -> None:
    """Install (``enable``) or remove fsdp's special-memory comm objects on this unit's CUDA groups
    (not recursive, as in FSDP2); a user's comm object raises first, changing nothing."""
    groups = self._fsdp_state.groups
    for group in groups:
        pairs = ((group.comms.all_gather_comm, "all gather"), (group.comms.reduce_scatter_comm, "reduce scatter"))
        for comm, name in pairs:
            if comm is not None and not isinstance(comm, custom_comm._MemoryComm):
                raise CustomCommConflictError(
                    f"cannot call {what}() when {name} comm is custom: {type(comm).__name__} (set by "
                    f"set_custom_all_gather/set_custom_reduce_scatter; it decides its own allocation)"
                )
    for group in groups:
        device = mesh_device(group.mesh)
        if kind == "symmetric" and device.type != "cuda":
            raise RuntimeError(
                f"{what}: symmetric memory needs CUDA devices and NCCL; this unit's mesh is on {device.type} "
                f"(FSDP2 raises too: 'SymmetricMemory does not find allocation backend {backend}')"
            )
        comms = custom_comm.memory_comms(kind, group.mesh, device, backend) if enable else None
        gather, reduce = comms if comms is not None else (None, None)  # None: off, or gloo (no allocator)
        custom_comm.install(group, all_gather_comm=gather, reduce_scatter_comm=reduce)


def set_allocate_memory_from_process_group_for_comm(self: nn.Module, enable: bool) -> None:
    """This unit's collectives (not recursive) use buffers the process group allocates (NCCL:
    registered memory, zero-copy), one copy each way (:mod:`fsdp.compose.custom_comm`); no effect
    on gloo, as in FSDP2. A unit with a custom comm object raises ``CustomCommConflictError``."""
    if not isinstance(enable, bool):
        raise ArgumentTypeError(f"enable must be a bool, got {enable!r}")
    _comm_memory(self, "set_allocate_memory_from_process_group_for_comm", "process_group", enable)


def set_symm_mem_for_comm(self: nn.Module, backend: Literal["NCCL"] = "NCCL") -> None:
    """This unit's collectives (not recursive) use symmetric-memory buffers (the reduce-scatter only
    when it sums, as NCCL's). A barrier: call on every rank. Off CUDA it raises ``RuntimeError``."""
    if backend != "NCCL":
        raise ValueError(f"set_symm_mem_for_comm: only backend='NCCL' exists, got {backend!r}")
    _comm_memory(self, "set_symm_mem_for_comm", "symmetric", True, backend)


def share_comm_ctx(modules: list[nn.Module]) -> None:
    """FSDP2 (pipeline parallelism): make several roots share their comm streams. fsdp's units on
    one device always do (:mod:`fsdp.group.streams`), so this only checks ``modules``: modules
    returned by ``fully_shard``, else FSDP2's ``ValueError``. No collective, no state changed."""
    for module in modules:
        if not isinstance(getattr(module, "_fsdp_state", None), FSDPState):
            raise ValueError(f"Expects list of FSDPModules but got {module}")


def data_parallel_mesh(
    mesh: Optional[DeviceMesh], dp_mesh_dims: Optional[DataParallelMeshDims]
) -> tuple[Optional[DeviceMesh], Optional[DataParallelDims]]:
    """``mesh`` as fsdp shards over it and, given ``dp_mesh_dims`` (torch 2.13's contract: ``mesh``
    is then the full SPMD mesh), its data-parallel sub-mesh (1-D for ``shard``, 2-D HSDP with
    ``replicate``; several names of a role are flattened) and dims. DTensor parameters on ``mesh``
    must be ``Replicate()`` on the dp dims; plain ones (which FSDP2 refuses) are sharded over the dp
    sub-mesh, each group along the other dims keeping its own values. ``replicate`` alone is refused
    (use ``shard=`` with ``sharding_strategy='no_shard'``); before torch 2.12 this raises
    ``dbuffer.torch_version.TorchVersionError``."""
    if dp_mesh_dims is None:
        return mesh, None
    compat.require_data_parallel_mesh_dims()  # torch before 2.12: raises, naming the version
    if not isinstance(dp_mesh_dims, DataParallelMeshDims):
        raise ArgumentTypeError(
            f"dp_mesh_dims must be a torch.distributed.fsdp.DataParallelMeshDims, got {type(dp_mesh_dims).__name__}"
        )
    if not isinstance(mesh, DeviceMesh):
        raise ValueError("dp_mesh_dims names dims of mesh=; pass the (named) DeviceMesh too")
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError("mesh must have mesh_dim_names when dp_mesh_dims is provided")
    shard, replicate = dp_mesh_dims.shard_names, dp_mesh_dims.replicate_names
    for name in shard + replicate:
        if name not in names:
            raise ValueError(f"Mesh dim name '{name}' not found in mesh.mesh_dim_names {names}")
    if len(set(shard + replicate)) != len(shard + replicate):
        raise ValueError(f"dp_mesh_dims names a mesh dim twice: shard={shard}, replicate={replicate}")
    if not shard:
        raise ValueError(
            f"dp_mesh_dims with replicate={replicate} only (FSDP2's DDP mode) is not supported; pass "
            f"dp_mesh_dims=DataParallelMeshDims(shard=...) with sharding_strategy='no_shard' instead"
        )

    def submesh(dims: tuple[str, ...]) -> DeviceMesh:
        return mesh[dims[0]] if len(dims) == 1 else mesh[dims]._flatten("_".join(dims))

    dp = DataParallelDims.of(mesh, shard, replicate)
    if not replicate:
        return submesh(shard), dp
    if len(shard) == 1 and len(replicate) == 1:
        return mesh[(replicate[0], shard[0])], dp
    return _concatenate(submesh(replicate), submesh(shard)), dp


def _concatenate(replicate: DeviceMesh, shard: DeviceMesh) -> DeviceMesh:
    return DeviceMesh._concatenate([replicate, shard])
