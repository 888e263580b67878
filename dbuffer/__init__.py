"""dbuffer: many tensors in one flat buffer, placed on a DeviceMesh with torch's placements.

The layout math (:mod:`dbuffer.layout`, :mod:`dbuffer.placements`) is pure; the buffer
(:class:`DBuffer`) owns all communication, through :mod:`dbuffer.collectives`.
"""

from dbuffer.buffer import DBuffer, distribute_tensors
from dbuffer.collectives import Pending
from dbuffer.dtensor import RowShardedDTensor
from dbuffer.layout import Layout, compute_layout

__all__ = ["DBuffer", "Layout", "Pending", "RowShardedDTensor", "compute_layout", "distribute_tensors"]
