"""RowShardedDTensor: a DTensor whose ``Shard(0)`` pieces are arbitrary contiguous row ranges.

DTensor's ``Shard(0)`` means "split like ``torch.chunk``" (nested per mesh axis). A row-atomic
DBuffer splits each tensor where the *buffer's* shard boundaries fall instead, so rank 0 may
hold 0 rows of a tensor and rank 1 all of them; that is what makes its gathers copy-free. A
plain DTensor built on such a piece would compute wrong values (``p * 2`` claims chunk rows,
``full_tensor()`` pads to chunk sizes and hangs or returns garbage). This subclass carries the
true rows (one count per shard, row-major over the sharded mesh axes) and makes every op exact:

* **Local ops** — pointwise ops (``p * 2``, ``torch.lerp``, ``addcdiv_``, every ``_foreach_*``
  but norms), ``*_like``, ``clone``, ``copy_``, casts: when every sharded operand has the same
  rows (a RowShardedDTensor with the same row counts, or a plain DTensor whose ``torch.chunk``
  rows happen to equal them) and the others are replicated values that broadcast along the rows,
  the op runs on the local pieces and the result keeps the rows. No communication. This is the
  path of optimizers, EMAs and weight decay.
* **Split-free reductions** — ``sum``, norms (``_foreach_norm``, ``linalg_vector_norm``),
  ``amax``/``amin``/``max``/``min``: DTensor reduces the local pieces and combines them as
  ``Partial``, which is right for any row split, so they go to DTensor unchanged (this is the
  path of ``clip_grad_norm_``).
* **Row-preserving views** — ``detach``, ``view``/slicing that keep dim 0 whole on every shard:
  a view with the same rows. A view that would move rows between ranks (``p.view(-1)``,
  ``p.t()``, ``p[0]``) raises: a copy would silently drop writes made through it.
* **Everything else** (matmul, ``mean``, random fills like ``uniform_``, ops mixing different
  row splits): computed on full tensors (each sharded operand gathered exactly), then each rank
  keeps its rows — of the result, or of an operand modified in place. Exact, and on every rank
  the same values a single process computes (random fills draw the whole tensor from each rank's
  generator: with the same seed everywhere that is the unsharded init), at the price of a
  gather. A result of another shape is returned replicated.

What it cannot do: ``to_local()`` returns this rank's true rows (not ``torch.chunk``'s), and
``redistribute`` goes through a full gather (exact, not communication-optimal).
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.utils._pytree import tree_flatten

from dbuffer.broadcast import broadcast_
from dbuffer.pieces import PieceShardedDTensor, map_tensors, run_on_full
from dbuffer.placements import sharded_axes

__all__ = ["RowShardedDTensor", "chunk_rows", "row_range"]

aten = torch.ops.aten

# Ops that are not tagged pointwise but act on each element independently of its neighbours.
_ELEMENTWISE = {
    aten.clone.default,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.empty_like.default,
    aten.full_like.default,
    aten.zero_.default,
    aten.fill_.Scalar,
    aten.copy_.default,
    aten._to_copy.default,
}
# Reductions whose DTensor rule (reduce local pieces, combine as Partial) holds for any row split;
# True where an empty piece is fine too (max of nothing is an error, so those need every shard
# to hold rows).
_SPLIT_FREE_REDUCTIONS = {
    aten.sum.default: True,
    aten.sum.dim_IntList: True,
    aten.linalg_vector_norm.default: True,
    aten._foreach_norm.Scalar: True,
    aten.amax.default: False,
    aten.amin.default: False,
    aten.max.default: False,
    aten.min.default: False,
}
_NOT_ELEMENTWISE_FOREACH = ("_foreach_norm", "_foreach_max")


def chunk_rows(num_rows: int, axis_sizes: Sequence[int]) -> tuple[int, ...]:
    """Rows per shard that DTensor assumes for ``Shard(0)`` on axes of ``axis_sizes`` (nested
    ``torch.chunk``, outer axis first), in row-major shard order. Cached: the dispatch below asks
    for every plain DTensor operand of every op (an optimizer's foreach step included)."""
    return _chunk_rows(num_rows, tuple(axis_sizes))


@functools.lru_cache(maxsize=4096)
def _chunk_rows(num_rows: int, axis_sizes: tuple[int, ...]) -> tuple[int, ...]:
    pieces = [num_rows]
    for size in axis_sizes:
        nxt = []
        for rows in pieces:
            step = -(-rows // size) if rows else 0
            nxt.extend(max(0, min(step, rows - k * step)) for k in range(size))
        pieces = nxt
    return tuple(pieces)


class RowShardedDTensor(PieceShardedDTensor):
    """A DTensor whose ``Shard(0)`` pieces are given row ranges; exact under every op (see the
    module docstring for how each kind of op is run).

    What :meth:`dbuffer.DBuffer.get_dtensor` (and fsdp's flat layouts) hand out where a tensor's
    rows per rank are not ``torch.chunk``'s. ``to_local()`` is this rank's true rows (possibly 0).
    Guarantees: pointwise ops, ``*_like``, copies, casts, ``_foreach_*`` and reductions DTensor
    combines as ``Partial`` (sum, norms, max) run on the local rows without communication when
    every sharded operand has the same rows; everything else (``full_tensor()``,
    ``redistribute``, matmul, ``mean``, random fills, ops mixing other pieces) is computed on
    gathered tensors and sliced back, so every result is the single-process value. A view that
    would move rows between ranks raises ``NotImplementedError`` naming the fix
    (``p.full_tensor()`` or ``redistribute``). DCP saves and loads it by its true rows.
    """

    _rows_per_shard: tuple[int, ...]
    _row_start: int

    @staticmethod
    def wrap(local: torch.Tensor, spec: DTensorSpec, rows_per_shard: tuple[int, ...], row_start: int) -> "RowShardedDTensor":
        """``local`` (this rank's rows, a view kept as is) as the piece of the tensor ``spec``
        describes, the ranks holding ``rows_per_shard`` rows each, this one from ``row_start``."""
        out = RowShardedDTensor(local, spec, requires_grad=False)
        out._rows_per_shard = rows_per_shard
        out._row_start = row_start
        return out

    def _with_local(self, local: torch.Tensor) -> "RowShardedDTensor":
        """``local`` (this rank's rows of a result shaped like this tensor) with these rows."""
        spec = self._spec  # specs are immutable: a result of this dtype shares it
        if local.dtype != self.dtype:
            spec = DTensorSpec(self.device_mesh, self.placements, TensorMeta(self.shape, self.stride(), local.dtype))
        return RowShardedDTensor.wrap(local, spec, self._rows_per_shard, self._row_start)

    # ------------------------------------------------------------------ whole-tensor views

    def _units_per_shard(self) -> tuple[int, ...]:
        return self._rows_per_shard

    def _unit_shape(self) -> tuple[int, ...]:
        return tuple(self.shape[1:])

    def piece_of(self, full: torch.Tensor) -> torch.Tensor:
        return full[self._row_start : self._row_start + self._local_tensor.shape[0]]

    @torch.no_grad()
    def full_tensor(self, *, grad_placements=None) -> torch.Tensor:  # type: ignore[override]
        """The whole tensor on every rank (a new tensor; not differentiable)."""
        local = self._reduced_local()
        holders = [k for k, rows in enumerate(self._rows_per_shard) if rows]
        axes = sharded_axes(self.placements)
        if len(holders) == 1 and len(axes) == 1:  # one rank holds every row (Owned): broadcast
            full = local.new_zeros(tuple(self.shape))
            if local.shape[0]:
                full.copy_(local)
            return broadcast_(full, self.device_mesh.get_group(axes[0]), src=holders[0])
        return self._gather_units(local)

    # ------------------------------------------------------------------ compile / pickling

    def __tensor_flatten__(self):
        names, context = super().__tensor_flatten__()
        return names, (context, self._rows_per_shard, self._row_start)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, flatten_spec, outer_size, outer_stride):
        context, rows, start = flatten_spec
        plain = DTensor.__tensor_unflatten__(inner_tensors, context, outer_size, outer_stride)
        return RowShardedDTensor.wrap(plain._local_tensor, plain._spec, rows, start).requires_grad_(plain.requires_grad)

    # ------------------------------------------------------------------ dispatch

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        # Elementwise first: an optimizer's step is nothing else, once per parameter per op.
        if _is_elementwise(func):
            refs = _common_rows(args, kwargs)
            if refs is not None:
                return _run_local(func, args, kwargs, refs)
        flat, tree = tree_flatten((args, kwargs))
        if func in _SPLIT_FREE_REDUCTIONS and (_SPLIT_FREE_REDUCTIONS[func] or _no_empty_piece(flat)):
            return _rewrap_rows(func(*_as_plain(args), **_as_plain(kwargs)), flat)
        if func.is_view:
            return _view(func, args, kwargs, flat)
        return run_on_full(func, args, kwargs, flat, tree)

    # ------------------------------------------------------------------ DCP

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


# ----------------------------------------------------------------------------- rows of a DTensor


def _rows(t: DTensor) -> Optional[tuple]:
    """How ``t``'s rows lie on its mesh: ``None`` for a replicated value, otherwise a key that is
    equal for two DTensors exactly when their local pieces are the same rows of same-shaped
    tensors (``"other"`` for layouts this module does not reason about: Partial, other dims).
    A RowShardedDTensor keeps its key: its mesh, placements, shape and rows never change."""
    if isinstance(t, RowShardedDTensor):
        key = t.__dict__.get("_row_key")
        if key is None:
            key = t.__dict__["_row_key"] = _rows_of(t)
        return key
    return _rows_of(t)


def _rows_of(t: DTensor) -> Optional[tuple]:
    placements = tuple(t.placements)
    if any(isinstance(p, Partial) for p in placements) or hasattr(t, "_elements_per_shard"):
        return ("other", id(t))  # element pieces (dbuffer.element_sharded) are not row ranges
    if any(isinstance(p, Shard) and (p.dim != 0 or type(p) is not Shard) for p in placements):
        return ("other", id(t))
    axes = sharded_axes(placements)
    if not axes:
        return None
    if isinstance(t, RowShardedDTensor):
        rows = t._rows_per_shard
    else:
        rows = chunk_rows(t.shape[0], [t.device_mesh.shape[a] for a in axes])
    return (t.device_mesh, placements, tuple(t.shape), rows)


def row_range(t: DTensor) -> tuple[int, int]:
    """Rows ``[start, end)`` of the full tensor (along dim 0) that ``t``'s local piece holds:
    its true rows for a RowShardedDTensor, DTensor's ``torch.chunk`` rows for a plain one, all
    rows when nothing is sharded. Only ``Shard(0)``, ``Replicate()`` and ``Partial`` placements."""
    from dbuffer.placements import shard_index

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


# ----------------------------------------------------------------------------- the three paths


_ELEMENTWISE_CACHE: dict = {}  # op -> whether it is elementwise (its tags and name never change)


def _is_elementwise(func) -> bool:
    known = _ELEMENTWISE_CACHE.get(func)
    if known is None:
        known = _ELEMENTWISE_CACHE[func] = _classify_elementwise(func)
    return known


def _classify_elementwise(func) -> bool:
    if torch.Tag.nondeterministic_seeded in func.tags:
        return False
    name = func._schema.name.split("::")[-1]
    if name.startswith("_foreach_"):
        return not name.startswith(_NOT_ELEMENTWISE_FOREACH)
    return torch.Tag.pointwise in func.tags or func in _ELEMENTWISE


def _common_rows(args: tuple, kwargs: dict) -> Optional[list[Optional[DTensor]]]:
    """For an elementwise op: per output position (one, or one per list element of a
    ``_foreach_*`` op), the sharded operand whose rows the result keeps (``None``: nothing
    sharded there) — or ``None`` if the pieces do not line up and the op must run on full
    tensors. A plain tensor operand of more than 0 dims raises, as DTensor does."""
    lists = [a for a in list(args) + list(kwargs.values()) if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
    singles = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
    width = len(lists[0]) if lists else 1
    refs: list[Optional[DTensor]] = []
    for i in range(width):
        operands = singles + [lst[i] for lst in lists if i < len(lst)]
        ref, key = None, None
        replicated = []
        for t in operands:
            if not isinstance(t, DTensor):
                if t.dim() > 0:
                    return None  # let the full path raise DTensor's error
                continue
            k = _rows(t)
            if k is None:
                replicated.append(t)
            elif k[0] == "other" or (key is not None and not _same_key(k, key)):
                return None
            elif ref is None:
                ref, key = t, k
        if ref is not None:
            for t in replicated:  # must broadcast along the rows, not index them
                if t.device_mesh != ref.device_mesh or t.dim() > ref.dim() or (t.dim() == ref.dim() and t.shape[0] != 1):
                    return None
        refs.append(ref)
    return refs


def _same_key(a: tuple, b: tuple) -> bool:
    return (a[0] is b[0] or a[0] == b[0]) and a[1:] == b[1:]


def _run_local(func, args: tuple, kwargs: dict, refs: list[Optional[DTensor]]):
    """Run an elementwise op on the local pieces; results keep their reference's rows."""
    out = func(*_locals(args), **_locals(kwargs))
    if _mutates_first(func):
        return None if out is None else args[0]  # in-place: the operand itself (foreach: nothing)
    if isinstance(out, (list, tuple)):
        return type(out)(_wrap_like(o, ref) for o, ref in zip(out, refs))
    return _wrap_like(out, refs[0])


def _wrap_like(local: Any, ref: Optional[DTensor]) -> Any:
    if not isinstance(local, torch.Tensor) or ref is None:
        return local
    if isinstance(ref, RowShardedDTensor):
        return ref._with_local(local)
    spec = ref._spec
    if local.dtype != ref.dtype:
        spec = DTensorSpec(ref.device_mesh, ref.placements, TensorMeta(ref.shape, ref.stride(), local.dtype))
    return DTensor(local, spec, requires_grad=False)


def _view(func, args: tuple, kwargs: dict, flat: list):
    """A view of a RowShardedDTensor keeps its rows, or raises if it would move rows."""
    src = args[0]
    if not isinstance(src, RowShardedDTensor):
        return func(*_as_plain(args), **_as_plain(kwargs))
    rest, local = args[1:], src._local_tensor
    if func not in _ROW_VIEWS:
        _check_keeps_rows(func, src, rest, kwargs)
    full = func(torch.empty(src.shape, dtype=src.dtype, device="meta"), *rest, **kwargs)
    out = func(local, *rest, **kwargs)
    if isinstance(out, (list, tuple)):
        return type(out)(_view_result(o, f, src) for o, f in zip(out, full))
    return _view_result(out, full, src)


# Views that keep every element where it is: no check needed.
_ROW_VIEWS = {aten.detach.default, aten.alias.default}


def _check_keeps_rows(func, src: "RowShardedDTensor", rest: tuple, kwargs: dict) -> None:
    """Raise unless ``func`` applied to each shard's rows gives exactly those rows of ``func``
    applied to the whole tensor. Probed with element ids (the same verdict on every rank)."""
    numel = src.numel()
    ids = torch.arange(numel, dtype=torch.int32 if numel < 2**31 else torch.int64).view(src.shape)
    try:
        whole = func(ids, *rest, **kwargs)
        ok, start = True, 0
        for rows in src._rows_per_shard:
            piece = func(ids[start : start + rows], *rest, **kwargs)
            ok = ok and _same_rows(whole, piece, start, rows, src.shape[0])
            start += rows
    except RuntimeError:
        ok = False
    if not ok:
        raise NotImplementedError(
            f"{func} on a row-sharded DTensor of shape {tuple(src.shape)} would move rows between "
            f"ranks (its pieces are a DBuffer's row ranges, not torch.chunk's); read it through "
            f"p.full_tensor() or p.redistribute(placements=[Replicate()] * mesh.ndim), or use a view "
            f"that keeps dim 0 (slicing or reshaping the other dims)"
        )


def _same_rows(whole: Any, piece: Any, start: int, rows: int, num_rows: int) -> bool:
    if isinstance(whole, (list, tuple)):
        return len(whole) == len(piece) and all(_same_rows(w, p, start, rows, num_rows) for w, p in zip(whole, piece))
    return (
        whole.dim() >= 1
        and whole.shape[0] == num_rows
        and piece.shape == whole[start : start + rows].shape
        and torch.equal(piece, whole[start : start + rows])
    )


def _view_result(local: torch.Tensor, full: torch.Tensor, src: "RowShardedDTensor") -> "RowShardedDTensor":
    meta = TensorMeta(full.shape, full.stride(), local.dtype)
    spec = DTensorSpec(src.device_mesh, src.placements, meta)
    return RowShardedDTensor.wrap(local, spec, src._rows_per_shard, src._row_start)


def _rewrap_rows(out: Any, flat: list) -> Any:
    """DTensor's result of a split-free reduction; one that kept dim 0 gets the input's rows."""
    ref = next(t for t in flat if isinstance(t, RowShardedDTensor))

    def fix(o):
        if isinstance(o, DTensor) and o.dim() >= 1 and o.shape[0] == ref.shape[0] and _rows(o) is not None:
            if o._local_tensor.shape[0] == ref._local_tensor.shape[0] and _rows(o)[0] != "other":
                return RowShardedDTensor.wrap(o._local_tensor, o._spec, ref._rows_per_shard, ref._row_start)
        return o

    return map_tensors(out, fix)


# ----------------------------------------------------------------------------- helpers


def _no_empty_piece(flat: list) -> bool:
    return all(0 not in t._rows_per_shard for t in flat if isinstance(t, RowShardedDTensor))


_MUTATES_FIRST: dict = {}


def _mutates_first(func) -> bool:
    known = _MUTATES_FIRST.get(func)
    if known is None:
        args = func._schema.arguments
        known = _MUTATES_FIRST[func] = bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write
    return known


def _locals(tree: Any) -> Any:
    if isinstance(tree, DTensor):
        return tree._local_tensor
    if isinstance(tree, (list, tuple)):
        return type(tree)(_locals(t) for t in tree)
    if isinstance(tree, dict):
        return {k: _locals(v) for k, v in tree.items()}
    return tree


def _as_plain(tree: Any) -> Any:
    """RowShardedDTensors as plain DTensors on the same pieces (for DTensor's own rules)."""
    if isinstance(tree, RowShardedDTensor):
        return DTensor(tree._local_tensor, tree._spec, requires_grad=False)
    if isinstance(tree, (list, tuple)):
        return type(tree)(_as_plain(t) for t in tree)
    if isinstance(tree, dict):
        return {k: _as_plain(v) for k, v in tree.items()}
    return tree
