"""Profiler labels: ``fsdp::<phase>`` ranges that show where a step spends its time in a trace.

Every phase of a unit (:mod:`fsdp.unit.state`) and every collective or copy of a group is
wrapped in :func:`label`, so ``torch.profiler`` traces show ``fsdp::pre_forward``,
``fsdp::all_gather``, ``fsdp::copy_out``, ``fsdp::reduce_scatter``, ``fsdp::optimizer_refresh``
and the rest (FSDP2 labels its own as ``FSDP::...``). Outside a profiler a label is a no-op
context: ``record_function`` itself costs about 15 us a call with no profiler on. A collective's
range also carries the group's ``dbuffer.CallLabel`` (what a failed collective names), entered by
the same ``with``: outside a profiler the call label is the only context entered.
"""

from __future__ import annotations

import contextlib
from typing import Optional

from torch.autograd import _profiler_enabled
from torch.profiler import record_function

from dbuffer import CallLabel

__all__ = ["label"]

_OFF = contextlib.nullcontext()  # stateless: one instance serves every label outside a profiler


def label(name: str, unit: Optional[str] = None, call: Optional[CallLabel] = None):
    """``record_function(name)``, with ``unit`` (a unit's name below the root) appended, while a
    profiler records; a no-op context otherwise. ``call``: the collectives' label, entered too."""
    if not _profiler_enabled():
        return _OFF if call is None else call
    ranged = record_function(f"{name} ({unit})" if unit else name)
    if call is None:
        return ranged
    stack = contextlib.ExitStack()  # profiling: the cost of two contexts does not matter
    stack.enter_context(ranged)
    stack.enter_context(call)
    return stack
