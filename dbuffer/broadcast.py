"""Exact broadcasts of one rank's tensor or object, for state dicts and Owned tensors.

Both run as an all-reduce sum of raw bytes in which every other rank contributes zeros: exact
for every dtype (``-0.0`` and NaN payloads included), and built on the one collective every
backend has.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch

from dbuffer import collectives

__all__ = ["broadcast_", "broadcast_object"]


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
