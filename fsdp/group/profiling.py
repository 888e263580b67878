"""Profiler labels: ``fsdp::<phase>`` ranges around a unit's phases and a group's collectives and
copies; a no-op context outside a profiler, where ``record_function`` is costly too. A collective's
``dbuffer.CallLabel`` (what a failed collective names) is entered by the same ``with``.
"""

from __future__ import annotations

import contextlib
from typing import Optional

from torch.autograd import _profiler_enabled
from torch.profiler import record_function

from dbuffer import CallLabel

__all__ = ["label"]

_OFF = contextlib.nullcontext()  # stateless: one instance serves every label


def label(name: str, unit: Optional[str] = None, call: Optional[CallLabel] = None):
    """``record_function(name)`` with ``unit`` appended while a profiler records, else a no-op
    context; ``call``: the collectives' label, entered too."""
    if not _profiler_enabled():
        return _OFF if call is None else call
    ranged = record_function(f"{name} ({unit})" if unit else name)
    if call is None:
        return ranged
    stack = contextlib.ExitStack()
    stack.enter_context(ranged)
    stack.enter_context(call)
    return stack
