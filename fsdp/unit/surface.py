"""The rest of torch FSDP2's public surface: ``FSDPModule``'s knobs, ``share_comm_ctx`` and
``dp_mesh_dims`` (``offload_policy``: :mod:`fsdp.compose.offload`), with FSDP2's semantics where fsdp has the mechanism, and
a documented no-op or a clear error where FSDP2 tunes an internal fsdp does not have.

The setters below become methods of :class:`fsdp.FSDPModule` (``self`` is the sharded module).
Like FSDP2's, each runs locally (no collective), so calling it on some ranks only cannot hang,
but a setting that changes what is communicated (divide factor, all-reduce) must be made on
every rank, as in FSDP2. Settings that change the gradient buffer's reduce op apply between
steps: while gradients wait to be reduced they raise, changing nothing.

Real (same effect as FSDP2): ``set_all_reduce_hook``, ``set_gradient_divide_factor`` (and its
deprecated alias), ``set_force_sum_reduction_for_comms``, ``set_requires_all_reduce``,
``set_unshard_in_backward``, ``set_post_optim_event``, ``set_reduce_scatter_max_input_buffers``,
``reset_iter_state``, ``set_reduce_scatter_unused_params`` (every parameter gets its reduced
gradient), ``set_custom_all_gather`` / ``set_custom_reduce_scatter`` (FSDP2's comm objects
called on fsdp's flat buffers, :mod:`fsdp.compose.custom_comm`), and the comm-memory setters on CUDA
meshes (fsdp's comm objects allocating from the process group or symmetric memory). Accepted,
no effect (fsdp already behaves so, or has no such internal): ``set_separate_reduce_scatter_group``
(dbuffer owns the process groups), ``share_comm_ctx`` (units on one device always share their
streams, :mod:`fsdp.group.streams`), ``set_allocate_memory_from_process_group_for_comm`` on gloo
(no allocator of its own, as in FSDP2). ``set_symm_mem_for_comm`` off CUDA raises ``RuntimeError``, as FSDP2's does.
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

__all__ = [
    "ArgumentTypeError",
    "DataParallelMeshDims",
    "data_parallel_mesh",
    "share_comm_ctx",
]


# FSDP2's class (torch 2.12+); on an older torch a stand-in whose constructor raises, naming the
# torch it needs (dbuffer.compat).
DataParallelMeshDims = compat.data_parallel_mesh_dims()


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type. A ``TypeError``; also a ``ValueError``, which is what
    torch FSDP2 raises in the same places (e.g. ``set_reshard_after_forward(2)``)."""


def _units(module: nn.Module, recurse: bool) -> list["FSDPState"]:
    return module._states(recurse)


def _set_reduction(module: nn.Module, recurse: bool, **changes: object) -> None:
    groups = [g for state in _units(module, recurse) for g in state.groups if g.requires_grad]
    for group in groups:  # every group is checked before any changes
        group.set_reduction(**changes)  # raises, changing nothing, mid-reduction


# ---------------------------------------------------------------- gradient reduction


def set_requires_all_reduce(self: nn.Module, requires_all_reduce: bool, *, recurse: bool = True) -> None:
    """HSDP: False reduce-scatters each backward's gradients within the shard group but defers
    the all-reduce across replicas; the reduce-scattered sums accumulate and are all-reduced by
    the next reduction with it on (e.g. the last microbatch). ``param.grad`` is not updated by
    a backward that defers. No effect on a 1-D mesh. Needs a strategy that reduce-scatters
    gradients (``optim_grads``, ``optim_grads_params``). Under HFSDP
    (``outer_dp_sharding_strategy="optim"``) the deferred step is the reduce-scatter across
    replicas."""
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
    """Call ``hook(reduced)`` on this unit's reduced gradient shard of each reduction (not
    recursive): after the reduce-scatter on a 1-D mesh (e.g. to all-reduce across groups you
    manage yourself), after the all-reduce across replicas on an HSDP mesh. ``reduced`` is this
    rank's flat shard (padding included) in the reduce dtype; change it in place. ``stream``
    (1-D meshes only, as in FSDP2): run the hook on that stream. See :mod:`fsdp.group.reduction`."""
    if not callable(hook):
        raise ArgumentTypeError(f"hook must be a callable (torch.Tensor) -> None, got {hook!r}")
    groups = [g for g in self._fsdp_state.groups if g.requires_grad]
    if stream is not None and any(g.mesh.ndim == 2 for g in groups):
        raise ValueError("stream cannot be set when using native HSDP")
    for group in groups:
        group.set_reduction(hook=hook, hook_stream=stream)


def set_gradient_divide_factor(self: nn.Module, factor: float) -> None:
    """Divide this unit's summed gradients by ``factor`` instead of averaging them over the
    data-parallel ranks (not recursive). The gradient buffer then reduces with ``sum``."""
    factor = check_divide_factor(factor)
    _set_reduction(self, False, divide_factor=factor)


def set_reduce_scatter_divide_factor(self: nn.Module, factor: float) -> None:
    """Deprecated in FSDP2: :meth:`set_gradient_divide_factor`."""
    set_gradient_divide_factor(self, factor)


def set_force_sum_reduction_for_comms(self: nn.Module, enable: bool) -> None:
    """True: this unit's collectives only sum (not recursive); the division by the divide factor
    (default: the number of data-parallel ranks) runs after, and after the all-reduce hook, as
    in FSDP2. The gradients are the same either way, up to rounding."""
    if not isinstance(enable, bool):
        raise ArgumentTypeError(f"enable must be a bool, got {enable!r}")
    _set_reduction(self, False, force_sum=enable)


def set_reduce_scatter_unused_params(
    self: nn.Module, reduce_scatter_unused_params: bool, *, recurse: bool = True
) -> None:
    """A parameter without a gradient always reduces as zeros in its group's one collective, so
    ranks that use different parameters never mismatch (FSDP2 needs this flag for that). True
    also attaches the reduced gradient to every parameter on every rank (zeros where no rank
    used it), which ranks running different parameters (MoE routing, multi-modal branches)
    need: with False a rank's ``.grad`` stays None for a parameter its own backward did not
    reach, even when other ranks' gradients for it are not zero, and its optimizer skips it."""
    if not isinstance(reduce_scatter_unused_params, bool):
        raise ArgumentTypeError(f"reduce_scatter_unused_params must be a bool, got {reduce_scatter_unused_params!r}")
    _set_reduction(self, recurse, unused_params=reduce_scatter_unused_params)


def set_reduce_scatter_max_input_buffers(self: nn.Module, max_input_buffers: int, *, recurse: bool = True) -> None:
    """How many gradient reductions may be in flight at once during backward (default 1: more
    buys overlap only when reductions are slower than a unit's backward, and each costs an
    unsharded gradient buffer at the peak). The tree's reductions are the root's to bound (its
    :class:`~fsdp.unit.root.RootContext`): set on any unit of an initialised tree, it applies to
    the tree; set before the first forward, the largest value set on a unit of the tree applies,
    as in FSDP2. ``recurse`` is accepted for FSDP2's signature."""
    if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
        raise TypeError(f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}")
    if max_input_buffers < 1:
        raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")
    for state in _units(self, recurse):
        state.root_knobs().max_reductions_in_flight = max_input_buffers


# ---------------------------------------------------------------- gathers, streams, iteration


def set_unshard_in_backward(self: nn.Module, unshard_in_backward: bool) -> None:
    """False: this unit's backward does not gather its weights again (not recursive), for units
    whose backward never reads them (an embedding: its gradient needs only the indices). A
    backward that does read them then reads freed storage, so only for such units."""
    if not isinstance(unshard_in_backward, bool):
        raise ArgumentTypeError(f"unshard_in_backward must be a bool, got {unshard_in_backward!r}")
    self._fsdp_state.unshard_in_backward = unshard_in_backward


def set_post_optim_event(self: nn.Module, event: DeviceEvent) -> None:
    """The root's next forward gathers only after ``event`` (recorded after the optimizer step);
    used once, then dropped. With real streams (CUDA, XPU) the all-gather stream waits for it;
    unlike FSDP2 it still waits for the current stream too (fsdp's launch always orders after
    it), so the event adds an ordering and removes none. Elsewhere (CPU) the host waits for the
    event (:meth:`fsdp.group.streams.CommStreams.gathers_wait`)."""
    if not hasattr(event, "synchronize"):
        raise ArgumentTypeError(f"event must be a torch.Event (or torch.cuda.Event), got {event!r}")
    self._fsdp_state.root_knobs().post_optim_event = event


def reset_iter_state(self: nn.Module) -> None:
    """After a forward or backward raised: call on the root, then train on. See
    :meth:`fsdp.unit.state.FSDPState.reset_iter_state` (the failed iteration's gradients are lost)."""
    self._fsdp_state.reset_iter_state()


# ---------------------------------------------------------------- FSDP2 internals fsdp lacks


def set_custom_all_gather(self: nn.Module, comm: AllGatherComm) -> None:
    """FSDP2's: gather this unit's weights (not recursive) with ``comm``, an object of FSDP2's
    ``AllGather`` protocol (``allocate`` + ``__call__(output_tensor=, input_tensor=, group=,
    async_op=)``), on the flat buffers dbuffer would have used; see :mod:`fsdp.compose.custom_comm`.
    Every group of the unit uses it (FSDP2 refuses units with several groups; fsdp calls the
    object once per group, with that group's process group). Set it on every rank."""
    custom_comm.check_comm(comm, "set_custom_all_gather", "AllGather")
    for group in self._fsdp_state.groups:
        custom_comm.install(group, all_gather_comm=comm)


def set_custom_reduce_scatter(self: nn.Module, comm: ReduceScatterComm) -> None:
    """FSDP2's: reduce-scatter this unit's gradients (not recursive) with ``comm``, an object of
    FSDP2's ``ReduceScatter`` protocol (``allocate`` + ``__call__(output_tensor=, input_tensor=,
    group=, op=, async_op=)``); see :mod:`fsdp.compose.custom_comm`. Set it on every rank."""
    custom_comm.check_comm(comm, "set_custom_reduce_scatter", "ReduceScatter")
    for group in self._fsdp_state.groups:
        custom_comm.install(group, reduce_scatter_comm=comm)


def set_separate_reduce_scatter_group(self: nn.Module, enable: bool = True, *, recurse: bool = True) -> None:
    """Accepted, no effect: dbuffer owns the process groups its collectives run on, and fsdp has
    at most one reduction in flight while the next unit's gather runs."""
    if not isinstance(enable, bool):
        raise ArgumentTypeError(f"enable must be a bool, got {enable!r}")


class CustomCommConflictError(ValueError, AssertionError):
    """A comm-memory setter on a unit with a custom comm object. A ``ValueError``; also an
    ``AssertionError``, which is what torch FSDP2 raises for it."""


def _comm_memory(self: nn.Module, what: str, kind: str, enable: bool, backend: str = "NCCL") -> None:
    """Install (``enable``) or remove fsdp's comm objects that allocate from special memory
    (:mod:`fsdp.compose.custom_comm`) on this unit's groups whose mesh is on CUDA (not recursive, as in
    FSDP2). A unit with a user's comm object raises first, changing nothing."""
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
    """FSDP2's: this unit's (not recursive) collectives read and write buffers allocated by the
    process group (NCCL: registered memory, for zero-copy transfers such as SHARP), staged to and
    from fsdp's persistent buffers by one copy each (:mod:`fsdp.compose.custom_comm`). No effect where the
    backend has no allocator of its own (gloo, as in FSDP2). A unit with a custom comm object
    raises ``CustomCommConflictError`` (a ``ValueError`` and FSDP2's ``AssertionError``)."""
    if not isinstance(enable, bool):
        raise ArgumentTypeError(f"enable must be a bool, got {enable!r}")
    _comm_memory(self, "set_allocate_memory_from_process_group_for_comm", "process_group", enable)


def set_symm_mem_for_comm(self: nn.Module, backend: Literal["NCCL"] = "NCCL") -> None:
    """FSDP2's: this unit's (not recursive) collectives use buffers from the symmetric-memory pool
    (NCCL's copy-engine / symmetric-kernel algorithms; the reduce-scatter's only when it sums,
    e.g. with ``set_force_sum_reduction_for_comms(True)``, as NCCL's symmetric reduce-scatter only
    sums). Collective (a barrier): call on every rank. Off CUDA it raises ``RuntimeError``, as
    FSDP2 does (symmetric memory needs CUDA and NCCL)."""
    if backend != "NCCL":
        raise ValueError(f"set_symm_mem_for_comm: only backend='NCCL' exists, got {backend!r}")
    _comm_memory(self, "set_symm_mem_for_comm", "symmetric", True, backend)


def share_comm_ctx(modules: list[nn.Module]) -> None:
    """FSDP2 (pipeline parallelism): make several roots share their comm streams. fsdp's units
    on one device always share them (one set per device, :mod:`fsdp.group.streams`), so this
    only checks its argument: ``modules``, modules returned by ``fully_shard``; anything else
    raises FSDP2's ``ValueError``. No collective, no state changed."""
    for module in modules:
        if not isinstance(getattr(module, "_fsdp_state", None), FSDPState):  # not a sharded module
            raise ValueError(f"Expects list of FSDPModules but got {module}")


# ---------------------------------------------------------------- fully_shard arguments


def data_parallel_mesh(
    mesh: Optional[DeviceMesh], dp_mesh_dims: Optional[DataParallelMeshDims]
) -> tuple[Optional[DeviceMesh], Optional[DataParallelDims]]:
    """``mesh`` as fsdp shards over it, and, given ``dp_mesh_dims``, its data-parallel dims.

    Without ``dp_mesh_dims``: ``(mesh, None)``. With it (torch 2.13's contract, torchtitan's
    ``full_dtensor`` and ``spmd_types``), ``mesh`` is the full SPMD mesh and the first value its
    data-parallel sub-mesh: ``shard`` alone gives a 1-D mesh, ``shard`` and ``replicate`` a 2-D
    ``(replicate, shard)`` HSDP mesh, several names of one role are flattened into one dim (as
    FSDP2 does). Dims named in neither role belong to other parallelisms (tensor parallelism).
    Parameters that are DTensors on ``mesh`` must be ``Replicate()`` on the dp dims and are
    sharded as FSDP2 shards them (:mod:`fsdp.compose.tensor_parallel`); plain parameters (which
    FSDP2 refuses here) are sharded over the dp sub-mesh, each group of ranks along the other
    dims keeping its own values (spmd_types' tensor-parallel-local tensors). ``replicate`` alone
    (FSDP2's DDP) is refused: use ``sharding_strategy='no_shard'`` with ``shard=``. On a torch
    without ``DataParallelMeshDims`` (before 2.12) any ``dp_mesh_dims`` raises
    ``dbuffer.torch_version.TorchVersionError`` naming the version needed."""
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
