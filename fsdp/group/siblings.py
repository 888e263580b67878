"""Where a group's main weights live (:func:`place_main`) and how its parts make buffers packing
the same tensors in the same layout (:class:`Siblings`). Parts get this recipe, not the main
weights themselves, whose old storage must not outlive a ``module.to(dtype)``."""

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
    """Main weights on ``device`` (the host under ``offload``) and the compute device; no rank
    check: fully_shard checked every rank builds the same unit."""
    if not offload.on_host or device.type == "meta":
        main = DBuffer(mesh, placements, shapes, dtype, device, layout=layout, check_ranks=False)
        return main, main.device
    host = cast(HostResidence, offload)  # on_host
    return host.buffer(mesh, placements, shapes, dtype, layout), host.compute_device


@dataclass(frozen=True)
class Siblings:
    """Buffers of the main weights' tensors and layout: on ``device``, or where the main weights
    live (``host``: the offload part; None: the device)."""

    mesh: DeviceMesh
    shapes: tuple
    layout: object
    device: torch.device
    host: Optional[HostResidence]

    @classmethod
    def of(cls, main: DBuffer, device: torch.device, offload: Residence) -> "Siblings":
        """The siblings of ``main`` computing on ``device``, with ``offload``'s host unless meta."""
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
