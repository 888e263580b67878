"""Where every tensor of a DBuffer lives: pure layout arithmetic, no torch.

A DBuffer packs tensors into one flat buffer of ``num_shards * shard_numel``
elements cut into equal contiguous shards. Two rules shape the layout:

* Each tensor is one contiguous slice, placed in the order given (parameter
  registration order), so an all-gathered buffer holds every tensor as a plain
  view and the element order, hence every reduction, is reproducible.
* Row atomicity: no shard boundary falls strictly inside a row (``shape[1:]``).
  Each shard then holds whole rows of each tensor, so a local piece is a
  ``[rows, *shape[1:]]`` view, which is what DTensor ``Shard(0)`` needs.

One module per kind of layout, all re-exported here (``from dbuffer.layout import ...``):

* :mod:`.packed`: :func:`compute_layout` builds the row-atomic :class:`Layout`, the default.
* :mod:`.owned`: :func:`compute_owned_layout` builds an :class:`OwnedLayout` for the ``Owned()``
  placement: every tensor whole inside the shard of one owner (:func:`assign_owners`).
* :mod:`.chunk`: :func:`compute_chunk_layout` builds a :class:`ChunkLayout`, every tensor split
  like ``torch.chunk(full, n, dim)`` (torch FSDP2's layout, ``shard_placement_fn``).
* :mod:`.ragged`: :func:`compute_ragged_layout` builds an element-granular :class:`RaggedLayout`
  (a boundary may split a row), for when row atomicity pads too much.
* :mod:`.choice`: :func:`choose_layout` picks between the row-atomic and the ragged layout by a
  padding threshold (:data:`MAX_ROW_ATOMIC_PADDING`).
* :mod:`.common`: :class:`ItemLayout` and what every layout shares (element counts, shard
  ranges, argument checks).
"""

from __future__ import annotations

from dbuffer.layout.choice import MAX_ROW_ATOMIC_PADDING, choose_layout
from dbuffer.layout.chunk import ChunkItem, ChunkLayout, compute_chunk_layout
from dbuffer.layout.common import ItemLayout, ItemRef
from dbuffer.layout.owned import OwnedLayout, assign_owners, compute_owned_layout
from dbuffer.layout.packed import Layout, compute_layout
from dbuffer.layout.ragged import RaggedLayout, compute_ragged_layout

__all__ = [
    "ChunkItem",
    "ChunkLayout",
    "ItemLayout",
    "Layout",
    "OwnedLayout",
    "RaggedLayout",
    "assign_owners",
    "choose_layout",
    "compute_chunk_layout",
    "compute_layout",
    "compute_owned_layout",
    "compute_ragged_layout",
]
