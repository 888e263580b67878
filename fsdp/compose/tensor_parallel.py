"""fully_shard over tensor- or expert-parallel DTensor parameters: FSDP x TP / EP on N-D meshes, as
torch FSDP2 does it (TP first, then ``fully_shard`` on the data-parallel submesh; user guide:
fsdp/README.md, "Composing with other features").

A DTensor parameter on a tensor-parallel mesh ``tp`` (other axes of the dp ``mesh``'s root) is
sharded by treating its *TP-local* tensor as the whole tensor, in exact ``torch.chunk`` pieces
(:class:`~fsdp.group.layouts.ChunkedLayout`: TP-local tensors rarely split row-atomically). The
sharded parameter is a DTensor on the joint mesh ``(dp..., tp...)`` with FSDP2's placements, so
state dicts, DCP and optimizer states are exact. A ``Partial`` gradient is redistributed to the
parameter's placements, as in FSDP2, before its local tensor is reduce-scattered on dp.

torch 2.13's ``dp_mesh_dims`` contract (torchtitan's ``full_dtensor``)::

    mesh = init_device_mesh("cuda", (dp, tp), mesh_dim_names=("dp_shard", "tp"))
    # every parameter a DTensor on the whole mesh: Replicate() on dp_shard, TP's placement on tp
    fully_shard(block, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp_shard"))

is the same sharding seen from the full mesh (:func:`full_mesh_sharding`); a gradient keeps its dp
placements there (the dp reduction reduces a ``Partial`` one).

:func:`clip_grad_norm_` clips gradients on several meshes, which torch's cannot (they do not stack).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence, Union

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from dbuffer import dtensor_view
from fsdp.group.bucket import mesh_key
from fsdp.group.comms import full_on_mesh_device
from fsdp.group.layouts import ParamKind
from fsdp.group.members import ParamInfo

__all__ = ["DataParallelDims", "TensorParallelKind", "TensorParallelSpec", "check_params", "clip_grad_norm_", "local_of"]


@dataclass(frozen=True)
class TensorParallelSpec:
    """What ``fully_shard`` keeps of a DTensor parameter to rebuild it around gathered locals."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size
    stride: tuple[int, ...]

    @classmethod
    def of(cls, param: DTensor) -> "TensorParallelSpec":
        return cls(param.device_mesh, tuple(param.placements), param.shape, tuple(param.stride()))

    def split_factor(self, dim: int) -> int:
        """Into how many pieces the TP placements cut ``dim`` (1: not at all)."""
        n = 1
        for axis, placement in enumerate(self.placements):
            if isinstance(placement, Shard) and placement.dim == dim:
                n *= self.mesh.size(axis)
        return n


def local_of(param: torch.Tensor) -> torch.Tensor:
    """The tensor fully_shard treats as whole: a DTensor's local tensor, anything else itself."""
    return param._local_tensor if isinstance(param, DTensor) else param


def joint_mesh(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> DeviceMesh:
    """The mesh ``(dp axes..., tp axes...)`` the sharded parameters live on (FSDP2's too)."""
    return DeviceMesh._concatenate([dp_mesh, tp_mesh])


def joint_placements(dp_ndim: int, dim: int, spec: TensorParallelSpec) -> tuple[Placement, ...]:
    """Placements on :func:`joint_mesh`: replicated on an HSDP replicate axis, split along ``dim``
    on the dp shard axis *within* each TP piece (``_StridedShard``), then TP's own."""
    factor = spec.split_factor(dim)
    dp = _StridedShard(dim, split_factor=factor) if factor > 1 else Shard(dim)
    return (Replicate(),) * (dp_ndim - 1) + (dp,) + spec.placements


@dataclass(frozen=True)
class DataParallelDims:
    """``dp_mesh_dims`` as indices into the full ``mesh``; only DTensor parameters on ``mesh``
    follow FSDP2's full-mesh contract, the others are sharded over the dp sub-mesh."""

    mesh: DeviceMesh
    shard: tuple[int, ...]
    replicate: tuple[int, ...]

    @classmethod
    def of(cls, mesh: DeviceMesh, shard: Sequence[str], replicate: Sequence[str]) -> "DataParallelDims":
        names = list(mesh.mesh_dim_names)
        return cls(mesh, tuple(names.index(n) for n in shard), tuple(names.index(n) for n in replicate))

    def names(self, dims: Sequence[int]) -> list[str]:
        return [self.mesh.mesh_dim_names[i] for i in dims]

    def holds(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is a DTensor on the full mesh (the full-mesh contract applies)."""
        return isinstance(param, DTensor) and param.device_mesh == self.mesh


def full_mesh_sharding(
    spmd: DataParallelDims, dp_mesh: DeviceMesh, dim: int, spec: TensorParallelSpec
) -> tuple[DeviceMesh, tuple[Placement, ...]]:
    """FSDP2's sharded parameter under ``dp_mesh_dims``: the full mesh, with ``Shard(dim)`` (or
    ``_StridedShard``) on the dp shard dim; several shard dims become one, flattened."""
    mesh, placements = spmd.mesh, list(spec.placements)
    for i in spmd.shard:
        later = [j for j in range(i + 1, mesh.ndim) if isinstance(spec.placements[j], Shard) and spec.placements[j].dim == dim]
        factor = math.prod(mesh.size(j) for j in later)
        placements[i] = _StridedShard(dim, split_factor=factor) if factor > 1 else Shard(dim)
    if len(spmd.shard) == 1:
        return mesh, tuple(placements)
    parts: list[DeviceMesh] = []
    out: list[Placement] = []
    for i, name in enumerate(mesh.mesh_dim_names):
        if i == spmd.shard[0]:
            parts.append(dp_mesh)
            out += [Replicate()] * (dp_mesh.ndim - 1) + [placements[i]]
        elif i not in spmd.shard and not (dp_mesh.ndim == 2 and i in spmd.replicate):
            parts.append(mesh[name])
            out.append(placements[i])
    return DeviceMesh._concatenate(parts), tuple(out)


def check_params(
    infos: list[ParamInfo], dp_mesh: DeviceMesh, dims: Optional[list[int]], strategy, spmd: Optional[DataParallelDims] = None
) -> None:
    """Raise a ``ValueError`` naming the fix for a DTensor parameter fully_shard cannot shard over
    ``dp_mesh`` (``spmd``: given ``dp_mesh_dims``); runs before any collective, on every rank."""
    for info in infos:
        p = info.param
        if not isinstance(p, DTensor):
            continue
        where = f"parameter {info.fqn!r} (a DTensor on {p.device_mesh}, placements {tuple(p.placements)})"
        if dims is None or not strategy.shard_optim:
            raise ValueError(
                f"{where}: DTensor (tensor/expert-parallel) parameters are sharded in exact torch.chunk pieces "
                f"by a strategy that shards the main weights; keep them out of explicit Buckets and use "
                f"sharding_strategy 'optim', 'optim_grads' or 'optim_grads_params'"
            )
        for placement in p.placements:
            if placement.is_partial():
                raise ValueError(
                    f"{where} has a Partial placement: its values are pending a reduction, so there is no "
                    f"weight to shard. Redistribute it to Shard/Replicate before fully_shard (e.g. "
                    f"nn.Parameter(p.redistribute(placements=[Replicate()])))"
                )
            if not isinstance(placement, (Shard, Replicate)) or isinstance(placement, _StridedShard):
                raise ValueError(f"{where}: fully_shard supports Shard and Replicate TP placements, not {placement!r}")
        tp_mesh = p.device_mesh
        if tp_mesh.device_type != dp_mesh.device_type:
            raise ValueError(f"{where} is on device type {tp_mesh.device_type!r} but the dp mesh on {dp_mesh.device_type!r}")
        if spmd is not None and spmd.holds(p):
            _check_full_mesh(where, p, spmd)
        else:
            _check_sub_mesh(where, p, dp_mesh, spmd)
        if not local_of(p).is_contiguous():
            raise ValueError(f"{where}: its local tensor is not contiguous; make it so (.contiguous()) before fully_shard")


def _check_full_mesh(where: str, p: DTensor, spmd: DataParallelDims) -> None:
    """FSDP2's contract: ``Replicate()`` on every dp dim; several shard dims adjacent, in order."""
    dp = spmd.shard + spmd.replicate
    for i in dp:
        if not isinstance(p.placements[i], Replicate):
            role = "shard" if i in spmd.shard else "replicate"
            fixed = [Replicate() if j in dp else q for j, q in enumerate(p.placements)]
            raise ValueError(
                f"{where} is {p.placements[i]!r} on the data-parallel {role} dim {spmd.names([i])[0]!r}: with "
                f"dp_mesh_dims every parameter on the full mesh must be Replicate() on the data-parallel dims "
                f"{spmd.names(dp)} (fsdp shards it there, as FSDP2 does); make it so before fully_shard, e.g. "
                f"nn.Parameter(p.redistribute(placements={fixed!r}))"
            )
    if list(spmd.shard) != list(range(spmd.shard[0], spmd.shard[0] + len(spmd.shard))):
        raise ValueError(
            f"{where}: dp_mesh_dims.shard names the mesh dims {spmd.names(spmd.shard)}, which fsdp flattens into one "
            f"shard dim of the parameters on the full mesh; they must be adjacent dims of the mesh, in its order"
        )


def _check_sub_mesh(where: str, p: DTensor, dp_mesh: DeviceMesh, spmd: Optional[DataParallelDims]) -> None:
    """A TP parameter's own mesh must be a sub-mesh of the dp mesh's root, on other axes."""
    tp_mesh = p.device_mesh
    if tp_mesh._get_root_mesh() is not dp_mesh._get_root_mesh() and not _same_root(tp_mesh, dp_mesh):
        raise ValueError(
            f"{where}: the dp mesh {dp_mesh} is not a sub-mesh of the parameter mesh's root mesh; slice "
            f"both from one mesh, e.g. mesh = init_device_mesh(..., mesh_dim_names=('dp', 'tp')), "
            f"parallelize_module(..., mesh['tp']), fully_shard(..., mesh=mesh['dp'])"
        )
    if dp_mesh.mesh_dim_names is None or tp_mesh.mesh_dim_names is None:
        raise ValueError(
            f"{where}: the dp mesh and the parameter's mesh must have axis names (the sharded parameter "
            f"lives on their concatenation); build the mesh with init_device_mesh(..., mesh_dim_names=('dp', 'tp'))"
        )
    dp_names = spmd.names(spmd.shard + spmd.replicate) if spmd is not None else list(dp_mesh.mesh_dim_names)
    shared = [n for n in tp_mesh.mesh_dim_names if n in dp_names]
    if shared and spmd is not None:
        raise ValueError(
            f"{where} is distributed over the data-parallel dim(s) {shared} on a mesh other than the full mesh "
            f"passed as mesh= with dp_mesh_dims ({spmd.mesh}): make it a DTensor on that full mesh, Replicate() on "
            f"the data-parallel dims (e.g. distribute_tensor(full, mesh, placements)), as FSDP2 requires; a "
            f"tensor-parallel parameter may instead live on a sub-mesh of the other dims (e.g. mesh['tp'])"
        )
    if shared and all(isinstance(p.placements[tp_mesh.mesh_dim_names.index(n)], Replicate) for n in shared):
        raise ValueError(
            f"{where} is Replicate() on the data-parallel mesh's dim(s) {shared}: the full-mesh layout of torch's "
            f"dp_mesh_dims (torchtitan's full_dtensor). Pass fully_shard the parameter's whole mesh and name its "
            f"data-parallel dims: fully_shard(..., mesh=<that mesh>, dp_mesh_dims={_dims_hint(dp_mesh)})"
        )
    if shared:
        raise ValueError(
            f"{where} is tensor-parallel over mesh axis {sorted(shared)}, which is also the data-parallel "
            f"mesh's axis: TP and FSDP must use different axes; pass fully_shard the other axes, e.g. mesh=mesh['dp']"
        )
    try:
        joint_mesh(dp_mesh, tp_mesh)
    except RuntimeError as e:
        raise ValueError(
            f"{where}: the dp mesh {dp_mesh} and the parameter's mesh overlap or come from different "
            f"meshes ({e}); slice them from one mesh on disjoint axes"
        ) from None


def _dims_hint(dp_mesh: DeviceMesh) -> str:
    names = dp_mesh.mesh_dim_names
    if dp_mesh.ndim == 1:
        return f"DataParallelMeshDims(shard={names[0]!r})"
    return f"DataParallelMeshDims(shard={names[1]!r}, replicate={names[0]!r})"


def _same_root(a: DeviceMesh, b: DeviceMesh) -> bool:
    ra, rb = a._get_root_mesh(), b._get_root_mesh()
    return ra.device_type == rb.device_type and torch.equal(ra.mesh, rb.mesh) and ra.mesh_dim_names == rb.mesh_dim_names


class TensorParallelKind(ParamKind):
    """The kind of a :class:`~fsdp.group.layouts.ChunkedLayout` group of DTensors on one mesh."""

    plain = False

    def __init__(
        self, params: list[DTensor], dp_mesh: DeviceMesh, dims: list[int], spmd: Optional[DataParallelDims] = None
    ) -> None:
        self.specs = [TensorParallelSpec.of(p) for p in params]
        if spmd is not None and spmd.holds(params[0]):  # a group's parameters share one mesh
            self.dp_dims = frozenset(spmd.shard + spmd.replicate)
            self.shardings = [full_mesh_sharding(spmd, dp_mesh, d, s) for d, s in zip(dims, self.specs)]
        else:
            self.dp_dims = frozenset()
            joint = joint_mesh(dp_mesh, self.specs[0].mesh)
            self.shardings = [(joint, joint_placements(dp_mesh.ndim, d, s)) for d, s in zip(dims, self.specs)]

    def local(self, param: torch.Tensor) -> torch.Tensor:
        return local_of(param)

    def sharded(self, k: int, local: torch.Tensor, mesh: DeviceMesh, placements: tuple, shape: torch.Size) -> DTensor:
        s, (on, placed) = self.specs[k], self.shardings[k]  # not the layout's mesh and placements
        return dtensor_view(local, on, placed, s.shape, s.stride)

    def unsharded(self, k: int, full: torch.Tensor, requires_grad: bool) -> nn.Parameter:
        s = self.specs[k]
        tensor = dtensor_view(full, s.mesh, s.placements, s.shape, s.stride)
        return nn.Parameter(tensor, requires_grad=requires_grad)

    def grad_local(self, k: int, grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if isinstance(grad, DTensor):
            s = self.specs[k]
            # a dp dim keeps the gradient's placement (FSDP2): the dp reduction sums a Partial one
            target = tuple(g if i in self.dp_dims else q for i, (g, q) in enumerate(zip(grad.placements, s.placements)))
            if tuple(grad.placements) != target:
                grad = grad.redistribute(s.mesh, target)
            grad = grad._local_tensor
            if hasattr(grad, "wait"):  # an AsyncCollectiveTensor
                grad = grad.wait()
        return grad


@torch.no_grad()
def clip_grad_norm_(
    parameters: Union[torch.Tensor, Iterable[torch.Tensor]],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: Optional[bool] = None,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for gradients on any mix of meshes and plain tensors.

    Each mesh's gradients get torch's norm (one collective per mesh), combined exactly as one norm
    over all, then every local piece is scaled. Returns the total norm as a plain tensor, alike on
    every rank; every rank must pass parameters on the same meshes in the same order.

    Arguments as torch's: ``parameters`` (a tensor or an iterable; those without ``.grad`` are
    skipped), ``max_norm``, ``norm_type`` (``inf`` for the max norm), ``error_if_nonfinite``
    (raise ``RuntimeError`` when the total norm is NaN or infinite, before any gradient is scaled),
    ``foreach`` (``False``: scale one tensor at a time)."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    norm_type = float(norm_type)
    if not grads:
        return torch.tensor(0.0)
    groups: dict[Optional[tuple], list[torch.Tensor]] = {}
    for g in grads:
        key = None if not isinstance(g, DTensor) else (mesh_key(g), id(type(g)))
        groups.setdefault(key, []).append(g)
    norms = []
    for members in groups.values():
        norm = torch.nn.utils.get_total_norm(members, norm_type, error_if_nonfinite=False, foreach=foreach)
        norms.append(full_on_mesh_device(norm.to_local(), norm.device_mesh, norm.placements)
                     if isinstance(norm, DTensor) else norm)
    device = norms[0].device
    norms = [n.to(device) for n in norms]
    stacked = torch.stack(norms)
    total = stacked.max() if math.isinf(norm_type) else torch.linalg.vector_norm(stacked, norm_type)
    if error_if_nonfinite and (total.isnan() or total.isinf()):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot "
            f"be clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            f"`error_if_nonfinite=False`"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    locals_ = [local_of(g) for g in grads]  # scaling every local piece scales the DTensor exactly
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for t in locals_:
        by_kind.setdefault((t.device, t.dtype), []).append(t)
    for (dev, _), members in by_kind.items():
        scale = coef.to(dev)
        if foreach is False:
            for t in members:
                t.mul_(scale)
        else:
            torch._foreach_mul_(members, scale)
    return total
