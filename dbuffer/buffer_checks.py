"""DBuffer's argument checks: the constructor's shapes and ``local_buffer``, a primitive's axis
and source placement, an ``out=`` buffer, :func:`~dbuffer.buffer.distribute_tensors`' tensors.

Each raises (or names) the problem and its fix before any collective, identically on every rank,
so no rank is left waiting (CONTRIBUTING, "Validate before communicating"). Nothing here
communicates; :mod:`dbuffer.buffer` calls these and raises with the caller's name.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from dbuffer.layout import OwnedLayout
from dbuffer.placements import AnyPlacement, Owned, is_shard

__all__ = [
    "check_local_buffer", "check_primitive", "check_shapes", "check_tensors", "out_lacks_storage", "out_mismatch", "out_problem",
]

# The placement a primitive's axis must have before it runs.
PRIMITIVE_SOURCES = {"allgather": (Shard, Owned), "reduce_scatter": (Partial,), "allreduce": (Partial,), "scatter": (Replicate,)}


def check_shapes(shapes: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    try:
        return [tuple(int(d) for d in s) for s in shapes]
    except TypeError:
        raise TypeError("tensor_shapes must be a sequence of shapes (sequences of ints)") from None


def check_local_buffer(t: torch.Tensor, numel: int, dtype: torch.dtype, device: torch.device) -> None:
    if t.dim() != 1 or not t.is_contiguous():
        raise ValueError(
            f"local_buffer must be a contiguous 1-D tensor, got shape {tuple(t.shape)} "
            f"(contiguous={t.is_contiguous()}); pass t.reshape(-1).contiguous()"
        )
    if t.numel() != numel:
        raise ValueError(
            f"local_buffer has {t.numel()} elements but this rank's shard holds {numel} "
            f"(layout for these shapes and placements)"
        )
    if t.dtype != dtype:
        raise ValueError(f"local_buffer has dtype {t.dtype}, expected {dtype}")
    if t.device != device:
        raise ValueError(f"local_buffer is on {t.device}, expected {device}")


def check_primitive(kind: str, axis: int, placements: Sequence[AnyPlacement], ndim: int) -> None:
    """Primitive ``kind`` may run on mesh ``axis`` of a buffer with ``placements`` on a mesh of
    ``ndim`` axes: the axis exists, has the placement ``kind`` starts from, and (for the kinds
    that shard or gather) is the innermost sharded one."""
    if not 0 <= axis < ndim:
        raise ValueError(f"axis must be in [0, {ndim}) for this mesh, got {axis}")
    have = placements[axis]
    if not isinstance(have, PRIMITIVE_SOURCES[kind]):
        needs = " or ".join(t.__name__ for t in PRIMITIVE_SOURCES[kind])
        raise ValueError(
            f"{kind} on axis {axis} needs a {needs} placement there, "
            f"but the buffer is {have}; use redistribute() to get there"
        )
    if kind in ("allgather", "reduce_scatter", "scatter"):
        inner = [a for a in range(axis + 1, ndim) if is_shard(placements[a])]
        if inner:
            raise ValueError(
                f"{kind} on axis {axis} while inner axes {inner} are sharded would make "
                f"non-contiguous shards; use redistribute(), which orders the axes for you"
            )


def out_problem(buf, out, placements: Sequence[AnyPlacement], dtype: torch.dtype) -> str | None:
    """What makes the DBuffer ``out`` unfit to receive a result of ``buf``'s with ``placements``
    and ``dtype`` now (a phrase whose subject is ``out``), or None if it fits: it must match
    (:func:`out_mismatch`) and have storage."""
    problem = out_mismatch(buf, out, placements, dtype)
    if problem is None and out_lacks_storage(out):
        return "has released storage; call out.reallocate_storage() first"
    return problem


def out_lacks_storage(out) -> bool:
    """Whether the DBuffer ``out`` cannot be written now: its storage released (or cut)."""
    return out.local_buffer.numel() != out._shard_numel or out.is_storage_released()


def out_mismatch(buf, out, placements: Sequence[AnyPlacement], dtype: torch.dtype) -> str | None:
    """What makes the DBuffer ``out`` the wrong buffer for a result of ``buf``'s with
    ``placements`` and ``dtype`` (mesh, placements, layout, dtype, device; its storage aside), or None."""
    if out.mesh is not buf.mesh and out.mesh != buf.mesh:
        return f"lives on mesh {out.mesh}, not {buf.mesh}"
    if tuple(out.placements) != tuple(placements):
        return f"has placements {list(out.placements)}; the result has {list(placements)}"
    if out.layout is not buf.layout and out.layout != buf.layout:
        if isinstance(out.layout, OwnedLayout) != buf.is_owned:
            mine, theirs = ("an owned", "a packed") if buf.is_owned else ("a packed", "an owned")
            return f"has {theirs} layout but this buffer has {mine} one; build out with layout=<this buffer>.layout"
        return "holds different tensor shapes (a different layout)"
    if out.dtype != dtype:
        return f"has dtype {out.dtype}; the result has {dtype}"
    if out.device != buf.device:
        return f"is on {out.device}; the result is on {buf.device}"
    return None


def check_tensors(tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], torch.dtype, torch.device | None]:
    """``tensors`` detached, their one dtype (float32 if there are none) and their one device
    (None if they are on several)."""
    tensors = list(tensors)
    for k, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensors[{k}] is a {type(t).__name__}, not a torch.Tensor")
    tensors = [t.detach() for t in tensors]
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        raise ValueError(f"tensors have mixed dtypes {sorted(map(str, dtypes))}; a DBuffer holds one dtype, cast first")
    devices = {t.device for t in tensors}
    return tensors, dtypes.pop() if dtypes else torch.float32, devices.pop() if len(devices) == 1 else None
