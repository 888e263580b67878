"""``shard_placement_fn``'s answers: a dim per parameter, and (torch 2.15) a mesh of its own.

FSDP2's ``shard_placement_fn(param)`` returns ``Shard(dim)`` (shard the parameter in
``torch.chunk`` pieces along ``dim``), ``None`` (the default layout), or since torch 2.15 a
``ShardPlacementResult(placement, mesh_info)``: that placement on another data-parallel mesh
than the unit's, e.g. expert weights on an expert-data-parallel mesh. fsdp builds such
parameters into groups of their own on that mesh (as an explicit :class:`fsdp.Bucket` with a
mesh would be). :class:`ShardPlacementResult` is torch's class where torch has it, else one with
the same fields, so code written for torch 2.15 runs on older torch too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from fsdp.group.members import ParamInfo

try:  # torch 2.15 and later
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
except ImportError:  # older torch: the same fields

    @dataclass
    class ShardPlacementResult:  # type: ignore[no-redef]
        """What ``shard_placement_fn`` may return for a parameter (torch 2.15's class): its
        ``placement`` (``Shard(dim)``, or None for the default) on the data-parallel mesh of
        ``mesh_info`` (an ``FSDPMeshInfo`` / ``HSDPMeshInfo``: its ``mesh``, ``shard_mesh_dim``
        and ``replicate_mesh_dim``). fsdp raises ``ValueError`` at ``fully_shard`` for a mesh
        layout it cannot shard on (see :func:`resolve`)."""

        placement: Optional[Shard]
        mesh_info: object


__all__ = ["ShardPlacementError", "ShardPlacementResult", "resolve"]


class ShardPlacementError(ValueError, AssertionError):
    """``shard_placement_fn`` returned ``Shard(dim)`` for a dim the parameter lacks. A
    ``ValueError``; also an ``AssertionError``, which is what torch FSDP2 raises for it."""


def resolve(infos: list[ParamInfo], fn) -> tuple[Optional[list[Optional[int]]], Optional[list[Optional[DeviceMesh]]]]:
    """``shard_placement_fn``'s answer for every parameter: a dim (normalised) or None, and a
    mesh of its own or None; ``(None, None)`` without a function. Raises ``TypeError`` for a
    non-callable or an answer of another type, :class:`ShardPlacementError` for a dim the
    parameter lacks, ``ValueError`` for a ``mesh_info`` fsdp cannot shard on: a mesh of one or
    two dims (``(replicate, shard)`` for HSDP) is needed, without ``dp_mesh_dims``."""
    if fn is None:
        return None, None
    if not callable(fn):
        raise TypeError(f"shard_placement_fn must be a callable (nn.Parameter) -> Shard | ShardPlacementResult | None, got {fn!r}")
    dims: list[Optional[int]] = []
    meshes: list[Optional[DeviceMesh]] = []
    for info in infos:
        answer = fn(info.param)
        mesh = None
        if isinstance(answer, ShardPlacementResult):
            mesh = _mesh_of(answer.mesh_info, info.fqn)
            answer = answer.placement
        meshes.append(mesh)
        if answer is None:
            dims.append(None)
            continue
        if not isinstance(answer, Shard):
            raise TypeError(
                f"shard_placement_fn returned {answer!r} for parameter {info.fqn!r}; return Shard(dim), "
                f"ShardPlacementResult(placement, mesh_info) or None (the default layout)"
            )
        ndim, dim = info.param.dim(), answer.dim
        if not -ndim <= dim < ndim:
            raise ShardPlacementError(
                f"Shard dim {dim} is invalid for {ndim}D tensor: shard_placement_fn returned {answer!r} "
                f"for parameter {info.fqn!r} of shape {tuple(info.param.shape)}; return a dim in "
                f"[{-ndim}, {ndim}) or None"
            )
        dims.append(dim % ndim)
    return dims, (meshes if any(m is not None for m in meshes) else None)


def _mesh_of(info: object, fqn: str) -> DeviceMesh:
    mesh = getattr(info, "mesh", None)
    shard, replicate = getattr(info, "shard_mesh_dim", None), getattr(info, "replicate_mesh_dim", None)
    fix = (
        f"ShardPlacementResult for parameter {fqn!r}: fsdp shards on a 1-D mesh (shard_mesh_dim=0) or a 2-D "
        f"(replicate, shard) mesh (replicate_mesh_dim=0, shard_mesh_dim=1), without dp_mesh_dims"
    )
    if not isinstance(mesh, DeviceMesh) or getattr(info, "dp_mesh_dims", None) is not None:
        raise ValueError(f"{fix}; got mesh_info={info!r}")
    if (mesh.ndim, shard, replicate) not in ((1, 0, None), (2, 1, 0)):
        raise ValueError(f"{fix}; got a {mesh.ndim}-D mesh with shard_mesh_dim={shard}, replicate_mesh_dim={replicate}")
    return mesh
