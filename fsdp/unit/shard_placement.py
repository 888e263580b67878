"""``shard_placement_fn``'s answers: a dim per parameter, and (torch 2.15) a mesh of its own.

A :class:`ShardPlacementResult` places a parameter on another data-parallel mesh than the unit's
(e.g. expert weights); fsdp builds such parameters into groups of their own, as for a
:class:`fsdp.Bucket` with a mesh. Before torch 2.15 the class is a stand-in with the same fields.
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
        ``mesh_info``; ``fully_shard`` raises ``ValueError`` for one it cannot shard on."""

        placement: Optional[Shard]
        mesh_info: object


__all__ = ["ShardPlacementError", "ShardPlacementResult", "resolve"]


class ShardPlacementError(ValueError, AssertionError):
    """A ``Shard(dim)`` for a dim the parameter lacks; also an ``AssertionError``, as in FSDP2."""


def resolve(infos: list[ParamInfo], fn) -> tuple[Optional[list[Optional[int]]], Optional[list[Optional[DeviceMesh]]]]:
    """``fn``'s answer per parameter: a dim or None, and a mesh or None (``(None, None)`` without
    ``fn``). Raises ``TypeError`` for a non-callable or a wrong answer type,
    :class:`ShardPlacementError` for a dim the parameter lacks, ``ValueError`` for a ``mesh_info``
    fsdp cannot shard on."""
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
