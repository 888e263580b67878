"""Exact DTensor views of a DBuffer's tensors.

DTensor's ``Shard(0)`` means "split like ``torch.chunk``" (nested per mesh axis), but a row-atomic
layout splits each tensor where the *buffer's* shard boundaries fall, so rank 0 may hold 0 rows
of a tensor and rank 1 all of them. A plain DTensor built on such a local piece would report the
wrong global offsets to DCP and compute ``full_tensor()`` from the wrong sizes (it pads to chunk
sizes and hangs or returns garbage). :func:`make_dtensor` therefore returns:

* a plain ``DTensor`` view when the placements shard nothing, or when the tensor's rows happen to
  be split exactly as DTensor expects;
* otherwise a :class:`RowShardedDTensor` view: a DTensor (elementwise ops, optimizers,
  norms and ``torch.nn.utils.clip_grad_norm_`` work on it as on any DTensor) that knows its true
  row ranges, and uses them for ``full_tensor()``, ``redistribute(..., [Replicate()]*n)`` and the
  DCP hooks (``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``);
* for a 0-D tensor under sharding (DTensor cannot shard a scalar), a replicated copy.

DTensor does not know dbuffer's ``Owned()`` placement, so views of an Owned buffer say
``Shard(0)``: the owner's piece is every row, the others' pieces are empty (a RowShardedDTensor
unless that happens to be ``torch.chunk``'s split, e.g. a one-row tensor owned by rank 0).
``full_tensor()`` of such a view broadcasts from the owner instead of gathering padded pieces.

For state dicts it also offers :func:`row_range` (which rows of the full tensor a DTensor's local
piece holds, for both kinds) and :func:`broadcast_` / :func:`broadcast_object` (one rank's tensor
or object to every rank, bit for bit), so that a full tensor held by rank 0 can be loaded into
row-sharded parameters and optimizer state.
"""

from __future__ import annotations

import pickle
from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from dbuffer import collectives
from dbuffer.placements import Owned, is_shard, shard_index, sharded_axes

if TYPE_CHECKING:
    from dbuffer.buffer import DBuffer

__all__ = ["RowShardedDTensor", "broadcast_", "broadcast_object", "chunk_rows", "make_dtensor", "row_range"]


def chunk_rows(num_rows: int, axis_sizes: Sequence[int]) -> tuple[int, ...]:
    """Rows per shard that DTensor assumes for ``Shard(0)`` on axes of ``axis_sizes`` (nested
    ``torch.chunk``, outer axis first), in row-major shard order."""
    pieces = [num_rows]
    for size in axis_sizes:
        nxt = []
        for rows in pieces:
            step = -(-rows // size) if rows else 0
            nxt.extend(max(0, min(step, rows - k * step)) for k in range(size))
        pieces = nxt
    return tuple(pieces)


def dtensor_placements(placements: Sequence[Any]) -> tuple:
    """A DBuffer's placements as DTensor placements: ``Owned()`` becomes ``Shard(0)``."""
    return tuple(Shard(0) if isinstance(p, Owned) else p for p in placements)


def make_dtensor(buf: "DBuffer", i: int) -> DTensor:
    item = buf.layout.items[i]
    local = buf.get_local_tensor(i)
    shape, stride = torch.Size(item.shape), _contiguous_stride(item.shape)
    placements = dtensor_placements(buf.placements)
    if buf.num_shards == 1:
        return DTensor.from_local(local, buf.mesh, placements, run_check=False, shape=shape, stride=stride)
    if len(item.shape) == 0:
        return _replicated_scalar(buf, local)
    axes = sharded_axes(buf.placements)
    rows = buf.layout.rows_per_shard(i, buf.num_shards)
    if rows == chunk_rows(item.num_rows, [buf.mesh.shape[a] for a in axes]):
        return DTensor.from_local(local, buf.mesh, placements, run_check=False, shape=shape, stride=stride)
    spec = DTensorSpec(buf.mesh, placements, TensorMeta(shape, stride, buf.dtype))
    out = RowShardedDTensor(local, spec, requires_grad=False)
    out._rows_per_shard = rows
    out._row_start = sum(rows[: buf.shard_index])
    return out


class RowShardedDTensor(DTensor):
    """A DTensor whose ``Shard(0)`` pieces are arbitrary contiguous row ranges (one per shard,
    row-major over the sharded mesh axes), as a row-atomic DBuffer layout produces them."""

    _rows_per_shard: tuple[int, ...]
    _row_start: int

    @torch.no_grad()
    def full_tensor(self, *, grad_placements=None) -> torch.Tensor:  # type: ignore[override]
        """The whole tensor on every rank (a new tensor; not differentiable)."""
        mesh, placements = self.device_mesh, self.placements
        local = self._local_tensor
        for axis, p in enumerate(placements):
            if isinstance(p, Partial):
                local = local.clone() if local is self._local_tensor else local
                collectives.all_reduce(local, p.reduce_op, mesh.get_group(axis))
        row_shape = tuple(self.shape[1:])
        holders = [k for k, rows in enumerate(self._rows_per_shard) if rows]
        axes = sharded_axes(placements)
        if len(holders) == 1 and len(axes) == 1:  # one rank holds every row (Owned): broadcast
            full = local.new_zeros(tuple(self.shape))
            if local.shape[0]:
                full.copy_(local)
            return broadcast_(full, mesh.get_group(axes[0]), src=holders[0])
        most = max(self._rows_per_shard)
        padded = local.new_zeros((most, *row_shape))
        padded[: local.shape[0]] = local
        gathered = padded.reshape(-1)
        for axis in reversed(sharded_axes(placements)):
            out = gathered.new_empty(gathered.numel() * mesh.shape[axis])
            collectives.all_gather(out, gathered, mesh.get_group(axis))
            gathered = out
        pieces = gathered.view(len(self._rows_per_shard), most, *row_shape)
        return torch.cat([pieces[k, :rows] for k, rows in enumerate(self._rows_per_shard)])

    def redistribute(self, device_mesh=None, placements=None, *, async_op: bool = False, **kwargs):  # type: ignore[override]
        mesh = device_mesh or self.device_mesh
        if mesh != self.device_mesh or placements is None or not all(isinstance(p, Replicate) for p in placements):
            raise NotImplementedError(
                "a RowShardedDTensor (row ranges of a DBuffer) redistributes only to "
                "[Replicate()] * mesh.ndim on its own mesh; redistribute the DBuffer instead"
            )
        return DTensor.from_local(self.full_tensor(), mesh, list(placements), run_check=False)

    def detach(self) -> "RowShardedDTensor":  # type: ignore[override]
        """Keep the subclass (and its row ranges): ``nn.Parameter(x)`` requires ``detach()`` to
        return the same type, and FSDP-style sharded parameters are Parameters of these views."""
        return self._same_rows(self._local_tensor.detach(), self._spec)

    def _same_rows(self, local: torch.Tensor, spec: DTensorSpec) -> "RowShardedDTensor":
        out = RowShardedDTensor(local, spec, requires_grad=False)
        out._rows_per_shard = self._rows_per_shard
        out._row_start = self._row_start
        return out

    def like(self, t: DTensor) -> "RowShardedDTensor":
        """``t`` (a DTensor made from this one, e.g. ``torch.zeros_like(self)``: same global shape,
        placements and local shape) as a RowShardedDTensor with this one's rows, sharing ``t``'s
        local tensor. DTensor ops return plain DTensors, which claim ``torch.chunk`` rows; this
        restores the truth (fsdp applies it to optimizer state after each step)."""
        if isinstance(t, RowShardedDTensor):
            return t
        if (
            not isinstance(t, DTensor)
            or t.shape != self.shape
            or t._local_tensor.shape != self._local_tensor.shape
            or tuple(t.placements) != tuple(self.placements)
        ):
            raise ValueError(
                f"like: {type(t).__name__} of shape {tuple(t.shape)} is not laid out like this "
                f"RowShardedDTensor of shape {tuple(self.shape)} (local {tuple(self._local_tensor.shape)})"
            )
        return self._same_rows(t._local_tensor, t._spec)

    # DCP: describe the true piece instead of the torch.chunk one.
    def _chunk(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        offsets = torch.Size([self._row_start] + [0] * (self.dim() - 1))
        return ChunkStorageMetadata(offsets=offsets, sizes=self._local_tensor.shape)

    def __create_write_items__(self, fqn: str, object: Any):
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        self._raise_if_contains_partial_placements()
        if self._local_tensor.shape[0] == 0:  # this rank holds none of the rows
            return []
        chunk = self._chunk()
        return [
            WriteItem(
                index=MetadataIndex(fqn, chunk.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=chunk,
                    properties=TensorProperties.create_from_tensor(self._local_tensor),
                    size=self.size(),
                ),
            )
        ]

    def __create_chunk_list__(self):
        self._raise_if_contains_partial_placements()
        return [] if self._local_tensor.shape[0] == 0 else [self._chunk()]

    def __get_tensor_shard__(self, index):
        return self._local_tensor


def _replicated_scalar(buf: "DBuffer", local: torch.Tensor) -> DTensor:
    value = local.sum() if local.numel() else local.new_zeros(())
    for axis in sharded_axes(buf.placements):
        collectives.all_reduce(value, "sum", buf.mesh.get_group(axis))
    placements = [Replicate() if is_shard(p) else p for p in buf.placements]
    return DTensor.from_local(value, buf.mesh, placements, run_check=False)


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(stride))


# ----------------------------------------------------------------------------- state dicts


def row_range(t: DTensor) -> tuple[int, int]:
    """Rows ``[start, end)`` of the full tensor (along dim 0) that ``t``'s local piece holds:
    its true rows for a RowShardedDTensor, DTensor's ``torch.chunk`` rows for a plain one, all
    rows when nothing is sharded. Only ``Shard(0)``, ``Replicate()`` and ``Partial`` placements."""
    if isinstance(t, RowShardedDTensor):
        return t._row_start, t._row_start + t._local_tensor.shape[0]
    placements = t.placements
    if any(isinstance(p, Shard) and p.dim != 0 for p in placements):
        raise ValueError(f"row_range: placements {list(placements)} shard a dim other than 0")
    axes = sharded_axes(placements)
    if t.dim() == 0 or not axes:
        return 0, (t.shape[0] if t.dim() else 1)
    mesh = t.device_mesh
    rows = chunk_rows(t.shape[0], [mesh.shape[a] for a in axes])
    k = shard_index(mesh.shape, placements, mesh.get_coordinate())
    start = sum(rows[:k])
    return start, start + rows[k]


def broadcast_(t: torch.Tensor, group=None, src: int = 0) -> torch.Tensor:
    """Overwrite ``t`` (contiguous, same shape and dtype on every rank) with group rank ``src``'s
    ``t``, bit for bit, in place. Runs as an all-reduce sum of the raw bytes with every other rank
    contributing zeros, which is exact for every dtype (``-0.0`` and NaN payloads included)."""
    if not t.is_contiguous():
        raise ValueError("broadcast_ needs a contiguous tensor")
    raw = t.reshape(-1).view(torch.uint8)
    if raw.numel():
        if torch.distributed.get_rank(group) != src:
            raw.zero_()
        collectives.all_reduce(raw, "sum", group)
    return t


def broadcast_object(obj: Any, group=None, src: int = 0, device: torch.device | str = "cpu") -> Any:
    """Group rank ``src``'s picklable ``obj`` on every rank (``obj`` is ignored elsewhere). If it
    cannot be pickled, every rank raises (no rank is left waiting)."""
    me = torch.distributed.get_rank(group) == src
    data = b""
    if me:
        try:
            data = pickle.dumps((True, obj))
        except Exception as exc:  # tell the others instead of leaving them waiting
            data = pickle.dumps((False, f"broadcast_object: cannot pickle the object: {exc!r}"))
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    broadcast_(size, group, src)
    buf = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    if me:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    broadcast_(buf, group, src)
    ok, value = pickle.loads(buf.cpu().numpy().tobytes())
    if not ok:
        raise TypeError(value)
    return obj if me else value
