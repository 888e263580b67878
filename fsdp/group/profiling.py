"""Profiler labels: ``fsdp::<phase>`` ranges that show where a step spends its time in a trace.

Every phase of a unit (:mod:`fsdp.unit.state`) and every collective or copy of a group is
wrapped in :func:`label`, so ``torch.profiler`` traces show ``fsdp::pre_forward``,
``fsdp::all_gather``, ``fsdp::copy_out``, ``fsdp::reduce_scatter``, ``fsdp::optimizer_refresh``
and the rest (FSDP2 labels its own as ``FSDP::...``). Outside a profiler a label is a no-op
context: ``record_function`` itself costs about 15 us a call with no profiler on.
"""

from __future__ import annotations

import contextlib
from typing import Optional

from torch.autograd import _profiler_enabled
from torch.profiler import record_function

__all__ = ["label"]

_OFF = contextlib.nullcontext()  # stateless: one instance serves every label outside a profiler


def label(name: str, unit: Optional[str] = None):
    """``record_function(name)``, with ``unit`` (a unit's name below the root) appended, while a
    profiler records; a no-op context otherwise."""
    if not _profiler_enabled():
        return _OFF
    return record_function(f"{name} ({unit})" if unit else name)
