"""Weights only forward reads: freed after forward by a unit that keeps the rest for backward.

The root unit keeps its gathered weights through backward, as in FSDP2, but an ``nn.Embedding``'s
weight is read only by the lookup (its gradient is scattered by index): in the usual root, half the
gathered bytes, held for nothing. Parameters registered only as exact ``nn.Embedding`` weights
(:func:`reads_only_in_forward`: a subclass may read it in forward, a tied head in backward) go last
in their group (:mod:`fsdp.group.bucket`). :class:`ForwardOnlyTail` holds their gradient
accumulators from registration (the forward's graph reuses them) and counts their Python references
and C++ holders (``Tensor._use_count``); if nothing else held them and the counts are unchanged
after forward (a tensor saved for backward, even a view, or ``ctx.weight = weight`` adds one), the
storage is shrunk to the prefix (whose tensors keep storage and offsets) and the tail registered
sharded, without a collective. Counts miss an alias made outside autograd (``weight.detach()``,
``.data``) read in backward: give such a root ``reshard_after_forward=False``. A recomputed forward
or ``unshard()`` gathers the whole group; a second forward before backward stops freeing.
"""

from __future__ import annotations

import sys
from typing import Sequence

import torch
import torch.nn as nn
from torch.autograd.graph import get_gradient_edge

from fsdp.group.members import ParamInfo

__all__ = ["ForwardOnlyTail", "reads_only_in_forward"]


def reads_only_in_forward(info: ParamInfo) -> bool:
    """Whether every registration is the ``weight`` of an exact ``nn.Embedding`` (see module)."""
    return bool(info.registrations) and all(
        type(module) is nn.Embedding and name == "weight" for module, name in info.registrations
    )


def _holders(params: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """Per tensor: (Python references, TensorImpl holders); always one frame, so calls compare."""
    return [(sys.getrefcount(p), p._use_count()) for p in params]


class ForwardOnlyTail:
    """The tail, from ``start`` on, of a group's parameters that only forward reads (see module)."""

    def __init__(self, start: int) -> None:
        self.start = start
        self._at_forward: list[tuple[int, int]] | None = None
        self._accumulators: list = []  # held from the registration to the check after forward

    def note_registration(self, unsharded: Sequence[torch.Tensor]) -> None:
        """At a forward's registration: hold the tail's gradient accumulators, note its holders."""
        tail = unsharded[self.start:]
        grad = torch.is_grad_enabled()
        self._accumulators = [get_gradient_edge(p).node for p in tail if grad and p.requires_grad]
        self._at_forward = _holders(tail)

    def unheld(self, unsharded: Sequence[torch.Tensor]) -> bool:
        """Whether only its accumulator held each tail parameter since :meth:`note_registration`."""
        before, self._at_forward = self._at_forward, None
        accumulators, self._accumulators = self._accumulators, []
        if before is None:
            return False
        now = _holders(unsharded[self.start:])
        held = 1 if accumulators else 0  # every tail parameter's accumulator, or none's
        if any(uses0 != 1 + held for _, uses0 in before):
            return False
        return now == before

    def release(self, buffer: torch.Tensor, unsharded: Sequence[torch.Tensor]) -> bool:
        """Shrink ``buffer``'s storage to the tail's start, or return False, changing nothing."""
        storage = buffer.untyped_storage()
        if buffer.storage_offset() != 0 or any(p.untyped_storage().data_ptr() != storage.data_ptr() for p in unsharded):
            return False
        keep = min(p.storage_offset() for p in unsharded[self.start:])
        if any(p.storage_offset() + p.numel() > keep for p in unsharded[: self.start]):
            return False
        storage.resize_(keep * buffer.element_size())
        return True
