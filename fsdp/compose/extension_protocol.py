"""FSDP2's all-gather extension protocol, the parts fully_shard needs before any group exists:
which parameters are extensions, the checks refusing what the extension path cannot do, and the
plain tensors behind a subclass. The group that gathers them is :mod:`fsdp.compose.extensions`."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

__all__ = ["POST", "PRE", "check_extension_params", "is_extension_param", "numel", "plain", "plain_leaves", "split_extension_members"]

PRE, POST = "fsdp_pre_all_gather", "fsdp_post_all_gather"


def is_extension_param(p: torch.Tensor) -> bool:
    """Whether ``fully_shard`` must keep ``p``'s type: it defines an all-gather method, or is a
    non-DTensor subclass with its own ``__torch_dispatch__``, which a flat buffer cannot hold."""
    if isinstance(p, DTensor):
        return False
    if hasattr(p, PRE) or hasattr(p, POST):
        return True
    return getattr(type(p), "__torch_dispatch__", None) is not torch.Tensor.__torch_dispatch__


def check_extension_params(fqns: Sequence[str], params: Sequence[torch.Tensor], specs) -> None:
    """Refuse, before any collective and alike on every rank, what the extension path cannot do."""
    for spec in specs:
        for j, k in enumerate(spec.members):
            p, name = params[k], fqns[k]
            if not is_extension_param(p):
                continue
            if hasattr(p, PRE) != hasattr(p, POST):
                have, lack = (PRE, POST) if hasattr(p, PRE) else (POST, PRE)
                raise ValueError(
                    f"parameter {name!r} ({type(p).__name__}) defines {have} but not {lack}; "
                    f"an all-gather extension needs both"
                )
            where = f"parameter {name!r} is a {type(p).__name__} (a tensor subclass / all-gather extension)"
            if not spec.strategy.shard_optim:
                raise ValueError(f"{where}, which fsdp shards as FSDP2 does; use a sharded strategy, not 'no_shard'")
            if type(spec.placement).__name__ == "Owned":
                raise ValueError(f"{where}; it is sharded like torch.chunk along dim 0: leave it out of Owned() buckets")
            if spec.dims is not None and spec.dims[j] != 0:
                raise ValueError(
                    f"{where}; it is sharded along dim 0 only, but shard_placement_fn returned "
                    f"Shard({spec.dims[j]}): return Shard(0) or None for it"
                )
            if not p.is_contiguous():
                raise ValueError(f"{where} and is not contiguous; pass a contiguous tensor")


def split_extension_members(spec, params: Sequence[torch.Tensor]) -> tuple[list[int], list[int]]:
    """(subclass group members, others) of a bucket spec, in order. Plain tensors cut along dim 0
    join extension members, so the unit makes one all-gather, as FSDP2 does."""
    ext = {k for k in spec.members if is_extension_param(params[k])}
    if ext:
        dims = dict(zip(spec.members, spec.dims)) if spec.dims is not None else {}
        ext |= {
            k for k in spec.members
            if type(params[k].detach()) is torch.Tensor and params[k].dim() > 0 and dims.get(k, 0) == 0
        }
    return [k for k in spec.members if k in ext], [k for k in spec.members if k not in ext]


def numel(shape: Sequence[int]) -> int:
    """The number of elements of ``shape``."""
    n = 1
    for d in shape:
        n *= d
    return n


def plain_leaves(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding ``t``'s storage (a wrapper subclass's inner tensors)."""
    if type(t) in (torch.Tensor, nn.Parameter) or not hasattr(t, "__tensor_flatten__"):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [leaf for name in names for leaf in plain_leaves(getattr(t, name))]


def plain(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a plain tensor (a subclass gradient is written through its own copy_)."""
    if type(t) in (torch.Tensor, nn.Parameter):
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)
