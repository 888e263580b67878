"""fully_shard's argument checks, raising alike on every rank before any buffer or collective,
then the one collective proving that ranks agree (:mod:`dbuffer.agreement`)."""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from dbuffer import CallLabel
from dbuffer.agreement import check_agreement, value_digest, values_comparable
from fsdp.compose.tensor_parallel import local_of
from fsdp.group.bucket import GroupSpec
from fsdp.group.layout_choice import describe_layout_policy
from fsdp.group.members import ParamInfo
from fsdp.group.policy import MixedPrecisionPolicy, Strategy

__all__ = [
    "MeshDimNamesError", "NonContiguousParameterError", "check_devices", "check_mesh",
    "check_offloadable", "check_params", "check_ranks_agree", "check_reshard_after_forward", "post_forward_ranks",
]


class MeshDimNamesError(ValueError, AssertionError):
    """A 2-D mesh without dim names; also an ``AssertionError``, which FSDP2 raises for it."""


class NonContiguousParameterError(ValueError, NotImplementedError):
    """A non-contiguous parameter; also a ``NotImplementedError``, which FSDP2 raises for it."""


def check_ranks_agree(mesh: DeviceMesh, infos: list[ParamInfo], specs: list[GroupSpec], config) -> None:
    """Raise :class:`dbuffer.agreement.RankMismatchError` unless every rank shards the same unit of
    the same values: one digest exchange per mesh, values compared within their bucket's mesh."""
    fix = (
        "Every rank must build the same model with the same values (same code and seed) and call "
        "fully_shard with the same arguments; or load one checkpoint on every rank."
    )
    structure = [("fully_shard arguments", repr(config)), ("layout policy", describe_layout_policy())]
    structure += [(i.fqn, f"shape {tuple(i.param.shape)} {i.param.dtype} requires_grad={i.param.requires_grad}") for i in infos]
    structure += [(f"{infos[k].fqn} placement", f"Shard({d})") for s in specs if s.dims for k, d in zip(s.members, s.dims)]
    values: dict[int, tuple[DeviceMesh, list]] = {}
    for spec in specs:
        target = values.setdefault(id(spec.mesh), (spec.mesh, []))[1]
        if values_comparable(spec.mesh):
            target += [(f"{infos[k].fqn} values", value_digest(local_of(infos[k].param))) for k in spec.members]
    mesh_values = values.pop(id(mesh), (mesh, []))[1]
    names = ", ".join(repr(i.fqn) for i in infos[:3]) + (", ..." if len(infos) > 3 else "")
    with CallLabel(f"fully_shard's check that every rank shards the same parameters ({names})"):
        check_agreement(mesh, structure + mesh_values, "fully_shard", fix)
        for other, entries in values.values():
            check_agreement(other, entries, "fully_shard (a bucket's mesh)", fix)


def check_devices(infos: list[ParamInfo]) -> None:
    devices = {info.param.device for info in infos}
    if len(devices) > 1:
        raise ValueError(f"the unit's parameters are on several devices {sorted(map(str, devices))}; move them to one")


def check_params(infos: list[ParamInfo], strategy: Strategy, policy: MixedPrecisionPolicy) -> None:
    for info in infos:
        p = info.param
        if not p.is_floating_point() and (policy.param_dtype is not None or policy.main_grads_dtype is not None):
            raise ValueError(
                f"parameter {info.fqn!r} has non-floating dtype {p.dtype} but the policy casts "
                f"(param_dtype={policy.param_dtype}); pass it in ignored_params or make it a buffer"
            )
        if p.dim() == 0 and strategy.shard_optim:
            raise ValueError(
                f"fully_shard doesn't support scalar parameters: parameter {info.fqn!r} is 0-D, which cannot "
                f"be sharded as a row range. Change {info.fqn} to a 1D tensor with numel equal to 1. (or use "
                f"sharding_strategy='no_shard')"
            )
        if not p.is_contiguous():
            raise NonContiguousParameterError(
                f"FSDP does not support non-contiguous parameters yet: parameter {info.fqn!r} of shape "
                f"{tuple(p.shape)} has strides {p.stride()} (e.g. channels_last); make it contiguous before "
                f"fully_shard (module.to(memory_format=torch.contiguous_format))"
            )


def check_reshard_after_forward(value: Optional[Union[bool, int]], mesh: DeviceMesh) -> Optional[bool]:
    """None and bools as they are; an int ``n`` (FSDP2: reshard to groups of ``n`` ranks) must
    divide the shard group's size: 1 keeps the weights (False), any other factor reshards."""
    if value is None or isinstance(value, bool):
        return value
    size = mesh.shape[-1]
    if not 1 <= value <= size or size % value:
        raise ValueError(
            f"reshard_after_forward as an int must be a factor of the shard group's size {size}, got {value}"
        )
    return value != 1


def post_forward_ranks(value: Optional[Union[bool, int]], mesh: DeviceMesh) -> Optional[int]:
    """The ``n`` of ``reshard_after_forward=n`` when it keeps a slice: an int strictly between
    1 and the size of a 1-D shard mesh (validated by :func:`check_reshard_after_forward`)."""
    if isinstance(value, bool) or not isinstance(value, int) or mesh.ndim != 1:
        return None
    return value if 1 < value < mesh.size() and mesh.size() % value == 0 else None


def check_mesh(
    mesh: Optional[DeviceMesh], infos: list[ParamInfo], what: str = "mesh", host_ok: bool = False
) -> DeviceMesh:
    """``host_ok`` (CPU offload): parameters on the CPU may be sharded over any mesh (the shards
    stay on the host), whose default device type is then the accelerator, if any."""
    param_type = infos[0].param.device.type if infos else "meta"
    if param_type != "meta" and not (host_ok and param_type == "cpu"):
        device_type = param_type
    else:  # no parameters of its own, built on meta, or offloaded: compute on the mesh's device
        default = "cuda" if torch.cuda.is_available() else "cpu"
        device_type = mesh.device_type if isinstance(mesh, DeviceMesh) else default
    if mesh is None:
        if not dist.is_initialized():
            raise RuntimeError("fully_shard needs torch.distributed initialised (or pass mesh=)")
        return init_device_mesh(device_type, (dist.get_world_size(),))
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{what} must be a torch DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh} as {what}: 1-D (the data-parallel "
            f"ranks) or 2-D (replicate, shard) for HSDP; slice it, e.g. mesh['dp_replicate', 'dp_shard'], "
            f"or name its data-parallel dims with dp_mesh_dims="
        )
    if mesh.ndim == 2 and mesh.mesh_dim_names is None:
        raise MeshDimNamesError(
            f"Please init the 2D mesh for HSDP with mesh_dim_names specified ({what} {mesh}), e.g. "
            f"init_device_mesh(..., mesh_dim_names=('replicate', 'shard')): the outer dim replicates, "
            f"the inner one shards"
        )
    if infos and mesh.device_type != device_type:
        raise ValueError(f"{what} is for device type {mesh.device_type!r} but the parameters are on {device_type!r}")
    if mesh.get_coordinate() is None:
        raise ValueError(f"this rank is not part of {what} {mesh}; call fully_shard only on its ranks")
    return mesh


def check_offloadable(infos: list[ParamInfo], policy: str = "CPUOffloadPolicy") -> None:
    for info in infos:
        kind = type(info.param.detach())
        if kind is not torch.Tensor:
            raise NotImplementedError(
                f"offload_policy={policy}(): parameter {info.fqn!r} is a {kind.__name__} (tensor "
                f"parallelism or an all-gather extension), which fsdp does not offload yet; shard the "
                f"modules holding such parameters without offload_policy (in their own fully_shard call)"
            )
