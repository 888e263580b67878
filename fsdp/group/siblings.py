"""Where a group's main weights live (:func:`place_main`) and its parts make their buffers:
:class:`Siblings` of the main weights.

Every buffer a group holds (model shard, gathered weights, gradients) packs the same tensors
as its main weights, in the same layout: a sibling. The group hands its parts this small
recipe instead of itself: the shapes and layout, the compute device, and the host part that
allocates pinned buffers under offload. Shapes only, not the main weights themselves, whose old
storage must not outlive a ``module.to(dtype)``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, cast

import torch
from torch.distributed.device_mesh import DeviceMesh

from dbuffer import DBuffer
from fsdp.group.residence import HostResidence, Residence

__all__ = ["Siblings", "place_main"]


def place_main(mesh: DeviceMesh, placements: Sequence, shapes: Sequence, dtype: torch.dtype, layout: object,
               device: torch.device, offload: Residence) -> tuple[DBuffer, torch.device]:
    """A group's main weights and the device it computes on: on ``device`` (meta for a
    meta-built group, else this rank's device), or on the host under ``offload``. fully_shard
    checked that every rank builds the same unit, so no rank check here."""
    if not offload.on_host or device.type == "meta":
        main = DBuffer(mesh, placements, shapes, dtype, device, layout=layout, check_ranks=False)
        return main, main.device
    host = cast(HostResidence, offload)  # on_host
    return host.buffer(mesh, placements, shapes, dtype, layout), host.compute_device


@dataclass(frozen=True)
class Siblings:
    """Buffers of the main weights' tensors and layout on ``mesh``: on the compute ``device``,
    or where the main weights live (``host``: the offload part that allocates host buffers;
    None: the device)."""

    mesh: DeviceMesh
    shapes: tuple
    layout: object  # the main weights' dbuffer layout
    device: torch.device
    host: Optional[HostResidence]

    @classmethod
    def of(cls, main: DBuffer, device: torch.device, offload: Residence) -> "Siblings":
        """The siblings of ``main``, computed with on ``device``; on the host where ``offload``
        keeps ``main`` there (not while it is on the meta device)."""
        host = cast(HostResidence, offload) if offload.on_host and main.device.type != "meta" else None
        return cls(main.mesh, tuple(main.shapes), main.layout, device, host)

    def on_device(self, placements: Sequence, dtype: torch.dtype, zero_fill: bool = False) -> DBuffer:
        """A buffer on the compute device (empty unless ``zero_fill``)."""
        return DBuffer(self.mesh, placements, self.shapes, dtype, self.device, layout=self.layout,
                       zero_fill=zero_fill, check_ranks=False)

    def where_main_lives(self, placements: Sequence, dtype: torch.dtype, zero_fill: bool = False) -> DBuffer:
        """A buffer where the main weights live: on the host (pinned) under offload."""
        if self.host is None:
            return self.on_device(placements, dtype, zero_fill)
        return self.host.buffer(self.mesh, placements, self.shapes, dtype, self.layout, zero_fill=zero_fill)
