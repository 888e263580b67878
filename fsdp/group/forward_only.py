"""Weights only forward reads: freed after forward by a unit that keeps the rest for backward.

The root unit keeps its gathered weights from its forward to the end of its backward, as in
FSDP2 (``reshard_after_forward=None``, the default): its backward would gather them again at once.
But an ``nn.Embedding``'s weight is read by the lookup and never by its backward (the gradient is
scattered into rows by index), and in the usual root, embedding + final norm + output head, that
is half of the root's gathered bytes held through the loss and the whole backward for nothing.

How fsdp frees it, without a collective more:

* **Order.** Parameters registered only as the ``weight`` of exact ``nn.Embedding`` modules
  (:func:`reads_only_in_forward`: a subclass may read it in its own forward, a tie with a head
  reads it in backward) go last in their group (:mod:`fsdp.group.bucket`), so they are the tail
  of the unsharded buffer.
* **Proof that nothing holds them.** At the unit's pre-forward registration this part takes hold
  of each tail parameter's gradient accumulator (the forward's graph reuses it) and notes how
  many Python references and C++ holders (``Tensor._use_count``) the parameter has: only its
  Python object and that accumulator, or the tail is kept. After forward the counts must be the
  same: a tensor saved for backward (the parameter, or any view of it: a view keeps its base)
  or a Python reference kept by the model (``ctx.weight = weight``) is one more, and the tail
  is then kept, as FSDP2 keeps it. What no count sees: an alias made outside autograd
  (``weight.detach()``, ``weight.data``) and read in backward; such a model passes
  ``reshard_after_forward=False`` to the root, which keeps everything.
* **Release.** The buffer's storage is resized to the prefix: its tensors (and any tensor saved
  of them) keep their storage and offsets; the tail's memory is returned. ``resize_`` moves the
  prefix into a new allocation: one device copy of the kept bytes per forward. The tail parameters
  are registered sharded on their modules, as after a reshard, so nothing reads the freed part.

Backward then gathers nothing for the tail (the unit's ``unshard_for_backward``). A recomputed
forward (activation checkpointing: the unit's, or the embedding module's own, hooked for it) or a
user's ``unshard()`` gathers the whole group again. A second forward before the backward (two
losses) would gather it again each time, so the group stops freeing its tail from then on; an
explicit ``reshard_after_forward=False`` (pipeline stages: several forwards before their
backwards) keeps everything, as asked.
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
    """Whether every registration of the parameter is the ``weight`` of an exact
    ``nn.Embedding``, whose backward never reads it."""
    return bool(info.registrations) and all(
        type(module) is nn.Embedding and name == "weight" for module, name in info.registrations
    )


def _holders(params: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """Per tensor: (Python references, C++ holders of its TensorImpl). Always called the same way
    (one frame, one argument), so the counts of two calls compare."""
    return [(sys.getrefcount(p), p._use_count()) for p in params]


class ForwardOnlyTail:
    """The tail of a group's parameters, from ``start`` on, that only forward reads: what holds
    them at the forward's registration, and the release after forward (see the module
    docstring). A part of :class:`~fsdp.group.param_group.ParameterGroup`, which drives it."""

    def __init__(self, start: int) -> None:
        self.start = start
        self._at_forward: list[tuple[int, int]] | None = None
        self._accumulators: list = []  # held from the registration to the check after forward

    def note_registration(self, unsharded: Sequence[torch.Tensor]) -> None:
        """The unsharded parameters were registered for a forward: take hold of the tail's
        gradient accumulators (autograd's, created if missing), which the forward's graph then
        reuses, and note what holds the tail."""
        tail = unsharded[self.start:]
        grad = torch.is_grad_enabled()
        self._accumulators = [get_gradient_edge(p).node for p in tail if grad and p.requires_grad]
        self._at_forward = _holders(tail)

    def unheld(self, unsharded: Sequence[torch.Tensor]) -> bool:
        """Whether nothing took hold of a tail parameter since :meth:`note_registration` (no
        tensor saved for backward is it or a view of it, no Python reference was kept), and
        nothing but its gradient accumulator held it then (no graph kept from before)."""
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
        """Shrink ``buffer``'s storage (the unsharded parameters' one) to the bytes before the
        tail; False, changing nothing, if the parameters are not views of it with the tail last."""
        storage = buffer.untyped_storage()
        if buffer.storage_offset() != 0 or any(p.untyped_storage().data_ptr() != storage.data_ptr() for p in unsharded):
            return False
        keep = min(p.storage_offset() for p in unsharded[self.start:])
        if any(p.storage_offset() + p.numel() > keep for p in unsharded[: self.start]):
            return False
        storage.resize_(keep * buffer.element_size())
        return True
