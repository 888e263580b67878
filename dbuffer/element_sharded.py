"""ElementShardedDTensor: a DTensor whose pieces are contiguous *element* ranges of the tensor.

A ragged DBuffer (:class:`dbuffer.layout.RaggedLayout`) cuts the flat buffer wherever the
elements fall, so a shard boundary may split a row. The piece of such a tensor on a rank is a
range ``[start, start + count)`` of its flattened (row-major) elements: a 1-D tensor, not a
``[rows, *shape[1:]]`` block, so neither a plain DTensor nor a
:class:`~dbuffer.row_sharded.RowShardedDTensor` can describe it. This sibling carries the element
counts of every shard (row-major over the sharded mesh axes) and makes every op exact:

* **Local ops** — pointwise ops, ``*_like``, ``clone``, ``copy_``, casts and the elementwise
  ``_foreach_*`` ops: when every sharded operand has the same element ranges of a same-shaped
  tensor and the other operands are scalars (0-D tensors, one-element replicated DTensors), the op
  runs on the 1-D local pieces and the result keeps the ranges. No communication: the path of
  optimizers (``torch.optim.AdamW``), EMAs, weight decay.
* **Reductions over all elements** — ``sum``, ``linalg_vector_norm`` (any order),
  ``_foreach_norm``, ``amax``/``amin``/``max``/``min``: the local piece is reduced and the result
  is a ``Partial`` DTensor (``Partial("sum")``, DTensor's p-norm partial, ``Partial("max")``),
  which is exact for any split. The path of ``clip_grad_norm_``.
* **Element-preserving views** — ``detach``, ``view``/``reshape``/``flatten`` to any shape, and
  any other view that an element-id probe shows keeps every element at its flat position: the
  same local piece under the new shape (the element ranges do not move). A view that would move
  elements (``t()``, ``p[0]``, a column slice) raises: a copy would silently drop writes made
  through it.
* **Everything else** (matmul, ``mean``, random fills, ops mixing different splits): computed on
  the full tensors (each sharded operand gathered exactly) and each rank keeps its elements — of
  the result, or of an operand modified in place. Exact, at the price of a gather.

``to_local()`` is this rank's 1-D piece. ``redistribute`` goes through ``full_tensor()``. For
checkpoints (DCP) a piece is written as the few rectangular boxes its element range covers (a
partial first row, whole rows, a partial last row; recursively for more dims): see
:func:`element_boxes`.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.utils._pytree import tree_flatten

from dbuffer.pieces import PieceShardedDTensor, run_on_full
from dbuffer.placements import sharded_axes
from dbuffer.row_sharded import RowShardedDTensor, _is_elementwise, _mutates_first
from dbuffer.view import contiguous_stride

__all__ = ["ElementShardedDTensor", "element_boxes", "element_range"]

aten = torch.ops.aten

_REDUCE_OPS = {
    aten.sum.default: "sum",
    aten.amax.default: "max",
    aten.max.default: "max",
    aten.amin.default: "min",
    aten.min.default: "min",
}


class ElementShardedDTensor(PieceShardedDTensor):
    """A DTensor whose local piece is elements ``[start, start + count)`` of the flattened tensor
    (1-D); exact under every op (see the module docstring for how each kind of op is run).

    What a ragged layout (:func:`dbuffer.compute_ragged_layout`, fsdp's ``layout_policy("ragged")``
    or ``"auto"`` at large worlds) hands out for a tensor whose rows a shard boundary cuts.
    Guarantees: pointwise ops, ``*_like``, copies, casts and ``_foreach_*`` run on the local
    elements when every sharded operand has the same element ranges; ``sum``/``norm``/``max``
    reduce locally into ``Partial`` DTensors; views that keep the element order (``view``,
    ``reshape``, ``flatten``) are allowed; everything else is computed on gathered tensors, so
    every result is the single-process value. A view that would move elements (``p.t()``,
    ``p[0]``) raises ``NotImplementedError`` naming the fix. DCP saves it as at most
    ``2 * ndim - 1`` boxes.
    """

    _elements_per_shard: tuple[int, ...]
    _element_start: int

    @staticmethod
    def wrap(local: torch.Tensor, spec: DTensorSpec, elements_per_shard: tuple[int, ...], start: int) -> "ElementShardedDTensor":
        """``local`` (1-D: this rank's elements, kept as is) as the piece of the tensor ``spec``
        describes, the ranks holding ``elements_per_shard`` elements each, this one from
        ``start``. ``ValueError`` if ``local`` is not 1-D."""
        if local.dim() != 1:
            raise ValueError(f"an element-sharded piece is 1-D, got shape {tuple(local.shape)}")
        out = ElementShardedDTensor(local, spec, requires_grad=False)
        out._elements_per_shard = tuple(elements_per_shard)
        out._element_start = start
        return out

    def _with_local(self, local: torch.Tensor, shape: Optional[Sequence[int]] = None) -> "ElementShardedDTensor":
        """``local`` (this rank's elements of a result shaped ``shape``, default this shape)."""
        shape = torch.Size(self.shape if shape is None else shape)
        meta = TensorMeta(shape, contiguous_stride(shape), local.dtype)
        spec = DTensorSpec(self.device_mesh, self.placements, meta)
        return ElementShardedDTensor.wrap(local, spec, self._elements_per_shard, self._element_start)

    @property
    def element_range(self) -> tuple[int, int]:
        """``[start, end)`` of the flattened tensor held by this rank."""
        return self._element_start, self._element_start + self._local_tensor.numel()

    # ------------------------------------------------------------------ whole-tensor views

    def _units_per_shard(self) -> tuple[int, ...]:
        return self._elements_per_shard

    def _unit_shape(self) -> tuple[int, ...]:
        return ()

    def piece_of(self, full: torch.Tensor) -> torch.Tensor:
        start, end = self.element_range
        return full.reshape(-1)[start:end]

    @torch.no_grad()
    def full_tensor(self, *, grad_placements=None) -> torch.Tensor:  # type: ignore[override]
        """The whole tensor on every rank (a new tensor; not differentiable)."""
        return self._gather_units(self._reduced_local()).view(self.shape)

    # ------------------------------------------------------------------ compile / pickling

    def __tensor_flatten__(self):
        names, context = super().__tensor_flatten__()
        return names, (context, self._elements_per_shard, self._element_start)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, flatten_spec, outer_size, outer_stride):
        context, counts, start = flatten_spec
        plain = DTensor.__tensor_unflatten__(inner_tensors, context, outer_size, outer_stride)
        out = ElementShardedDTensor.wrap(plain._local_tensor, plain._spec, counts, start)
        return out.requires_grad_(plain.requires_grad)

    # ------------------------------------------------------------------ dispatch

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        flat, tree = tree_flatten((args, kwargs))
        reduced = _reduce(func, args, kwargs)
        if reduced is not NotImplemented:
            return reduced
        if func.is_view and args and isinstance(args[0], ElementShardedDTensor):
            return _view(func, args, kwargs)
        if _is_elementwise(func):
            refs = _common_elements(args, kwargs)
            if refs is not None:
                return _run_local(func, args, kwargs, refs)
        return run_on_full(func, args, kwargs, flat, tree)

    # ------------------------------------------------------------------ DCP

    def _boxes(self) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
        start, end = self.element_range
        return element_boxes(tuple(self.shape), start, end)

    def __create_write_items__(self, fqn: str, object: Any):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        self._raise_if_contains_partial_placements()
        props = TensorProperties.create_from_tensor(self._local_tensor)
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
                    properties=props,
                    size=self.size(),
                ),
            )
            for offsets, sizes, _ in self._boxes()
        ]

    def __create_chunk_list__(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        self._raise_if_contains_partial_placements()
        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s, _ in self._boxes()]

    def __get_tensor_shard__(self, index):
        """The box of the local piece starting at ``index.offset``: a view (loads write into it)."""
        for offsets, sizes, local_start in self._boxes():
            if tuple(offsets) == tuple(index.offset):
                return self._local_tensor[local_start : local_start + math.prod(sizes)].view(sizes)
        raise ValueError(f"{index.fqn}: this rank holds no box of the tensor at offset {tuple(index.offset)}")


# ----------------------------------------------------------------------------- pure helpers


def element_boxes(shape: Sequence[int], start: int, end: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """The rectangular boxes ``(offsets, sizes, local_start)`` that elements ``[start, end)`` of a
    contiguous tensor of ``shape`` cover, in element order; ``local_start`` is where each begins in
    the 1-D piece. For a matrix: a partial first row, the whole rows, a partial last row (at most
    3); each further dim can split the partial rows again (at most ``2 * ndim - 1`` boxes). Every
    box is contiguous in the piece, so it is a view of it."""
    shape = tuple(shape)
    out: list[tuple[tuple[int, ...], tuple[int, ...], int]] = []
    _boxes_into(out, shape, start, end, (), start)
    return out


def _boxes_into(out: list, shape: tuple, start: int, end: int, prefix: tuple, base: int) -> None:
    if start >= end:
        return
    if not shape:  # 0-D: one element
        out.append((prefix, (), start - base))
        return
    inner = math.prod(shape[1:])
    if len(shape) == 1 or inner == 0:
        out.append((prefix + (start // max(inner, 1),) + (0,) * (len(shape) - 1), (end - start,) + shape[1:], start - base))
        return
    first, last = start // inner, end // inner  # rows holding start; row where end falls
    if first == last:  # inside one row
        _sub(out, shape, first, start - first * inner, end - first * inner, prefix, base - first * inner)
        return
    whole_from = first
    if start % inner:  # partial first row
        _sub(out, shape, first, start % inner, inner, prefix, base - first * inner)
        whole_from = first + 1
    if last > whole_from:
        zeros = (0,) * (len(shape) - 1)
        out.append((prefix + (whole_from,) + zeros, (last - whole_from,) + shape[1:], whole_from * inner - base))
    if end % inner:  # partial last row
        _sub(out, shape, last, 0, end % inner, prefix, base - last * inner)


def _sub(out: list, shape: tuple, row: int, start: int, end: int, prefix: tuple, base: int) -> None:
    """Boxes of elements ``[start, end)`` of row ``row`` (a tensor of ``shape[1:]``): each gets
    size 1 along dim 0 at ``row``."""
    inner: list = []
    _boxes_into(inner, shape[1:], start, end, (), base)
    for offsets, sizes, local in inner:
        out.append((prefix + (row,) + offsets, (1,) + sizes, local))



def element_range(t: DTensor) -> tuple[int, int]:
    """Elements ``[start, end)`` of the flattened full tensor that ``t``'s local piece holds, for
    an ElementShardedDTensor (its range), a RowShardedDTensor or a plain ``Shard(0)``/replicated
    DTensor (its rows times the row size)."""
    if isinstance(t, ElementShardedDTensor):
        return t.element_range
    from dbuffer.row_sharded import row_range

    r0, r1 = row_range(t)
    row = math.prod(t.shape[1:]) if t.dim() else 1
    return r0 * row, r1 * row


# ----------------------------------------------------------------------------- dispatch paths


def _key(t: DTensor) -> Optional[tuple]:
    """``None`` for a replicated value; else a key equal for two operands exactly when their local
    pieces are the same elements of same-shaped tensors (``"other"``: not element pieces)."""
    placements = tuple(t.placements)
    if isinstance(t, ElementShardedDTensor):
        if any(isinstance(p, Partial) for p in placements):
            return ("other", id(t))
        return (t.device_mesh, placements, tuple(t.shape), t._elements_per_shard)
    if any(isinstance(p, Partial) for p in placements) or sharded_axes(placements):
        return ("other", id(t))
    return None


def _common_elements(args: tuple, kwargs: dict) -> Optional[list[Optional[DTensor]]]:
    """Per output position of an elementwise op, the element-sharded operand whose ranges the
    result keeps, or ``None`` if the pieces do not line up (then the op runs on full tensors)."""
    values = list(args) + list(kwargs.values())
    lists = [a for a in values if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
    singles = [a for a in values if isinstance(a, torch.Tensor)]
    width = len(lists[0]) if lists else 1
    refs: list[Optional[DTensor]] = []
    for i in range(width):
        ref, key = None, None
        for t in singles + [lst[i] for lst in lists if i < len(lst)]:
            if not isinstance(t, DTensor):
                if t.dim() > 0:
                    return None  # the full path raises DTensor's mixed-tensor error
                continue
            k = _key(t)
            if k is None:
                if t.numel() != 1:  # a replicated operand must broadcast as a scalar
                    return None
                continue
            if k[0] == "other" or (key is not None and not (k[0] == key[0] and k[1:] == key[1:])):
                return None
            if ref is None:
                ref, key = t, k
        refs.append(ref)
    return refs


def _locals(tree: Any) -> Any:
    if isinstance(tree, DTensor):
        local = tree._local_tensor
        return local.reshape(()) if not isinstance(tree, ElementShardedDTensor) and local.numel() == 1 else local
    if isinstance(tree, (list, tuple)):
        return type(tree)(_locals(t) for t in tree)
    if isinstance(tree, dict):
        return {k: _locals(v) for k, v in tree.items()}
    return tree


def _run_local(func, args: tuple, kwargs: dict, refs: list[Optional[DTensor]]):
    out = func(*_locals(args), **_locals(kwargs))
    if _mutates_first(func):
        return None if out is None else args[0]
    if isinstance(out, (list, tuple)):
        return type(out)(_wrap(o, ref) for o, ref in zip(out, refs))
    return _wrap(out, refs[0])


def _wrap(local: Any, ref: Optional[DTensor]) -> Any:
    if not isinstance(local, torch.Tensor) or ref is None:
        return local
    return ref._with_local(local)


def _reduce(func, args: tuple, kwargs: dict):
    """All-element reductions of element-sharded tensors as Partial DTensors; NotImplemented if
    ``func`` is not one (or has a ``dim``, or a piece is empty where the op has no identity)."""
    if func is aten._foreach_norm.Scalar:
        tensors = args[0]
        ord_ = args[1] if len(args) > 1 else kwargs.get("ord", 2)
        dtype = args[2] if len(args) > 2 else kwargs.get("dtype")
        out = []
        for t in tensors:
            if isinstance(t, ElementShardedDTensor):
                r = _norm(t, ord_, dtype)
                if r is NotImplemented:
                    return NotImplemented
                out.append(r)
            else:  # plain or row-sharded DTensors: their own rules
                out.append(func([t], ord_, dtype)[0] if dtype is not None else func([t], ord_)[0])
        return out
    if not args or not isinstance(args[0], ElementShardedDTensor):
        return NotImplemented
    t = args[0]
    if func is aten.linalg_vector_norm.default:
        ord_ = args[1] if len(args) > 1 else kwargs.get("ord", 2)
        dim = args[2] if len(args) > 2 else kwargs.get("dim")
        keepdim = args[3] if len(args) > 3 else kwargs.get("keepdim", False)
        if dim is not None or keepdim:
            return NotImplemented
        return _norm(t, ord_, kwargs.get("dtype"))
    op = _REDUCE_OPS.get(func)
    if op is None or len(args) > 1 or set(kwargs) - {"dtype"}:
        return NotImplemented
    if any(isinstance(p, Partial) for p in t.placements):
        return NotImplemented
    if op != "sum" and 0 in t._elements_per_shard:  # max of nothing has no identity
        return NotImplemented
    return _partial(t, func(t._local_tensor, **kwargs), Partial(op))


def _norm(t: ElementShardedDTensor, ord_, dtype):
    from torch.distributed.tensor._ops._math_ops import _NormPartial

    if any(isinstance(p, Partial) for p in t.placements):
        return NotImplemented
    ord_ = float(ord_)
    local = t._local_tensor
    if ord_ == math.inf:
        value = local.abs().amax() if local.numel() else local.new_zeros(())
        placement: Partial = Partial("max")
    elif ord_ > 0 and not math.isinf(ord_):
        value = torch.linalg.vector_norm(local, ord_)
        placement = _NormPartial(ord_)
    else:  # -inf, 0 and negative orders: no split-free combination here
        return NotImplemented
    if dtype is not None:
        value = value.to(dtype)
    return _partial(t, value, placement)


def _partial(t: ElementShardedDTensor, value: torch.Tensor, placement: Partial) -> DTensor:
    placements = [placement if isinstance(p, Shard) else p for p in t.placements]
    return DTensor.from_local(value, t.device_mesh, placements, run_check=False)


def _view(func, args: tuple, kwargs: dict):
    src = args[0]
    rest = args[1:]
    full = func(torch.empty(src.shape, dtype=src.dtype, device="meta"), *rest, **kwargs)
    if func not in (aten.detach.default, aten.alias.default):
        _check_keeps_elements(func, src, rest, kwargs)
    return src._with_local(_alias(func, src), full.shape)


def _alias(func, src: ElementShardedDTensor) -> torch.Tensor:
    local = src._local_tensor
    return local.detach() if func is aten.detach.default else local.view(local.shape)


def _check_keeps_elements(func, src: ElementShardedDTensor, rest: tuple, kwargs: dict) -> None:
    """Raise unless ``func`` only reinterprets the shape: every element stays at its flat
    (row-major) position, so each rank's element range is unchanged."""
    numel = src.numel()
    ids = torch.arange(numel, dtype=torch.int64).view(src.shape)
    try:
        whole = func(ids, *rest, **kwargs)
        ok = (
            isinstance(whole, torch.Tensor)
            and whole.numel() == numel
            and whole.is_contiguous()
            and torch.equal(whole.reshape(-1), ids.reshape(-1))
        )
    except RuntimeError:
        ok = False
    if not ok:
        raise NotImplementedError(
            f"{func} on an element-sharded DTensor of shape {tuple(src.shape)} would move elements "
            f"between ranks (its pieces are element ranges of a ragged DBuffer, cut mid-row); read it "
            f"through p.full_tensor() or p.redistribute(placements=[Replicate()] * mesh.ndim), or use "
            f"a view that keeps the element order (view/reshape/flatten)"
        )
