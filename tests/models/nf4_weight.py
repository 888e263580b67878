"""A stand-in for torchao's ``NF4Tensor`` where ``fully_shard`` meets it: how it may be cut.

torchao's NF4 weight (QLoRA's frozen 4-bit base weight) supports splitting along dim 0 through
``aten.split`` (what ``torch.chunk`` dispatches to, and how FSDP2 cuts it), but refuses a slice
that does not span the whole dim (``NotImplementedError: aten.slice(NF4Tensor) with end=...``).
:class:`SplitOnlyTwoTensor` has that rule on top of torch's ``TwoTensor`` (two copies of the
values), so tests and the QLoRA recipe of fsdp/README.md exercise fsdp's cutting without torchao.
"""

from __future__ import annotations

import torch
from torch.testing._internal.two_tensor import TwoTensor

__all__ = ["SplitOnlyTwoTensor", "to_nf4"]


class SplitOnlyTwoTensor(TwoTensor):
    """``torch.chunk`` (``aten.split``) works; a partial ``aten.slice`` raises, as NF4's does."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        if func is torch.ops.aten.slice.Tensor:
            t, dim, start, end = (list(args) + [0, None, None])[:4]
            if (start or 0) != 0 or (end is not None and end < t.shape[dim]):
                raise NotImplementedError(f"aten.slice({cls.__name__}) with end={end}")
        out = super().__torch_dispatch__(func, types, args, kwargs)
        return torch.utils._pytree.tree_map_only(TwoTensor, lambda t: t if type(t) is cls else cls(t.a, t.b), out)


def to_nf4(weight: torch.Tensor) -> SplitOnlyTwoTensor:
    """In place of ``torchao.dtypes.to_nf4``: the weight's values, cut only as NF4 can be."""
    return SplitOnlyTwoTensor(weight.detach().clone(), weight.detach().clone())
