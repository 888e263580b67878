"""A counter of parameter registrations, which the optimizer step hooks read.

Every time fsdp registers a group's parameters on modules for the first time, or swaps a
parameter object (``to_empty``, adoption of assigned DTensors), an optimizer built earlier may
hold objects fsdp no longer trains. The core only counts; :mod:`fsdp.optim.step_hooks` checks
each optimizer again when the count has moved since its last check.
"""

from __future__ import annotations

__all__ = ["note_registration", "registrations"]

_COUNT = 0


def note_registration() -> None:
    """Parameters were (re)registered on modules: optimizers must be checked again."""
    global _COUNT
    _COUNT += 1


def registrations() -> int:
    """How many registrations :func:`note_registration` has counted in this process."""
    return _COUNT
