"""How a group's all-gather and reduction run: dbuffer's ``redistribute`` by default; FSDP2's
custom comm objects replace it with one of :mod:`fsdp.compose.custom_comm` (never imported here).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Protocol, Sequence, Union

import torch
from torch.distributed.device_mesh import DeviceMesh

from dbuffer import DBuffer, Pending, mesh_device

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup, ReduceOp, Work

__all__ = ["AllGatherComm", "DBUFFER_COMMS", "DBufferComms", "ReduceScatterComm", "full_on_mesh_device"]


class AllGatherComm(Protocol):
    """FSDP2's ``AllGather`` comm object, by its members (torch's class need not be its base)."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A tensor the collective writes (its output), in the object's memory."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: ProcessGroup,
                 async_op: bool = False) -> Optional[Work]:
        """``output_tensor`` = every rank's ``input_tensor`` over ``group``."""


class ReduceScatterComm(Protocol):
    """FSDP2's ``ReduceScatter`` comm object (``set_custom_reduce_scatter``), by its members."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A tensor the collective reads or writes, in the object's memory."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: ProcessGroup, op: ReduceOp,
                 async_op: bool = False) -> Optional[Work]:
        """``output_tensor`` = this rank's chunk of ``input_tensor`` reduced by ``op`` over ``group``."""


class DBufferComms:
    """dbuffer's own collectives (each backend's best algorithm, :mod:`dbuffer.collectives`)."""

    all_gather_comm: Optional[AllGatherComm] = None  # FSDP2's comm objects: none here
    reduce_scatter_comm: Optional[ReduceScatterComm] = None

    def all_gather(self, source: DBuffer, placements: tuple, target: DBuffer) -> Pending:
        """``target`` = ``source`` gathered to ``placements``, in flight."""
        return source.redistribute(placements, out=target, async_op=True)

    def reduce(self, source: DBuffer, placements: tuple, out: DBuffer,
               async_op: bool = True) -> Union[Pending, DBuffer]:
        """``out`` = ``source`` reduced to ``placements``: a Pending, or ``out`` unless ``async_op``."""
        return source.redistribute(placements, out=out, async_op=async_op)


DBUFFER_COMMS = DBufferComms()


def full_on_mesh_device(local: torch.Tensor, mesh: DeviceMesh, placements: Sequence) -> torch.Tensor:
    """The full value of ``local`` under ``placements`` over ``mesh``, reduced on the mesh's
    device (NCCL cannot reduce host tensors under CPU offload) and returned on ``local``'s."""
    from torch.distributed.tensor import DTensor

    on_mesh = local.to(mesh_device(mesh))
    return DTensor.from_local(on_mesh, mesh, tuple(placements), run_check=False).full_tensor().to(local.device)
