"""dbuffer: many tensors in one flat buffer, placed on a DeviceMesh with torch's placements.

The layout math (:mod:`dbuffer.layout`, :mod:`dbuffer.placements`) is pure; the buffer
(:class:`DBuffer`) owns all communication, through :mod:`dbuffer.collectives`.
"""

from dbuffer.buffer import DBuffer, distribute_tensors
from dbuffer.collectives import Pending, mesh_device
from dbuffer.element_sharded import ElementShardedDTensor
from dbuffer.row_sharded import RowShardedDTensor
from dbuffer.layout import (
    Layout,
    OwnedLayout,
    RaggedLayout,
    assign_owners,
    choose_layout,
    compute_layout,
    compute_owned_layout,
    compute_ragged_layout,
)
from dbuffer.placements import Owned

__all__ = [
    "DBuffer",
    "ElementShardedDTensor",
    "Layout",
    "Owned",
    "OwnedLayout",
    "Pending",
    "RaggedLayout",
    "RowShardedDTensor",
    "assign_owners",
    "choose_layout",
    "compute_layout",
    "compute_owned_layout",
    "compute_ragged_layout",
    "distribute_tensors",
    "mesh_device",
]
