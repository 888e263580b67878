"""A DTensor around a local tensor that stays a view on every device: :func:`dtensor_view`.

``DTensor.from_local`` first moves its local tensor to the mesh's device type
(``local.to(mesh.device_type)`` when they differ): a host tensor wrapped on a CUDA mesh becomes a
device *copy*. Where the DTensor is meant to be the buffer (a sharded parameter over host main
weights under CPU offload, ``param.grad`` over the host main grads) that copy is silently wrong:
the optimizer updates the copy, gathers read the unchanged buffer, and the gradients are a
snapshot of whatever the buffer held. On a CPU mesh nothing moves, so only a GPU shows it.

Every view dbuffer and fsdp hand out is therefore built here, as FSDP2 builds its sharded
parameters (the DTensor constructor, which keeps the local tensor as it is: same storage, same
device, pinned or not). ``DTensor.from_local`` stays right where a *new* value is wrapped (a
reduced scalar, a full tensor to redistribute) and moving it to the mesh's device is wanted.

Also :func:`contiguous_stride`, the strides of a contiguous tensor of a shape, which every view
of a full tensor's metadata needs.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._utils import compute_global_tensor_info

__all__ = ["contiguous_stride", "dtensor_view"]


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (a 0 in the shape counts as 1, as torch's)."""
    stride, acc = [], 1
    for d in reversed(tuple(shape)):
        stride.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(stride))


def dtensor_view(
    local: torch.Tensor,
    mesh: DeviceMesh,
    placements: Sequence,
    shape: Optional[Sequence[int]] = None,
    stride: Optional[Sequence[int]] = None,
) -> DTensor:
    """A DTensor on ``mesh`` whose local tensor *is* ``local`` (its storage and device, pinned
    or not: never a copy, whatever the mesh's device type), placed by ``placements`` (DTensor
    placements, one per mesh axis, shard dims non-negative), of the global ``shape`` (default:
    computed from the placements as ``from_local`` does, which assumes ``torch.chunk`` pieces)
    and ``stride`` (default: contiguous strides of ``shape``). Not differentiable with respect to
    ``local``: it builds parameters, gradients and optimizer state, not activations. Raises
    nothing of its own and communicates nothing; like ``from_local(run_check=False)`` it trusts
    that every rank's piece agrees with ``shape``."""
    placements = tuple(placements)
    if shape is None:
        shape, stride = compute_global_tensor_info(local, mesh, placements)
    shape = torch.Size(shape)
    stride = contiguous_stride(shape) if stride is None else tuple(stride)
    spec = DTensorSpec(mesh, placements, tensor_meta=TensorMeta(shape, stride, local.dtype))
    return DTensor(local, spec, requires_grad=local.requires_grad)
