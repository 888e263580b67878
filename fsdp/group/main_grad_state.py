"""What a group's ``main_grad`` buffer holds, and whether the parameters' ``.grad`` point at it
(:class:`MainGrad`), with the moves between those states checked.

Two questions decide what the gradient reducer does: does the next reduction *accumulate* into
``main_grad`` (it holds this step's gradients: micro-batches) or *overwrite* it (nothing live is
there), and are ``.grad`` / ``.main_grad`` of the sharded parameters views of it (then its storage
must stay, and a swapped parameter must be pointed again). The four answers are the states:

* ``EMPTY``: nothing live; ``.grad`` not ours. Its storage may be released.
* ``FILLED``: a reduction wrote gradients; not yet attached (the end of backward attaches them).
* ``ATTACHED``: gradients live and ``.grad`` points at them (the optimizer reads them).
* ``ZEROED``: ``.grad`` still points at the buffer, whose values are zero
  (``zero_grad_buffer``): the next reduction overwrites, and the views stay.

The moves (:data:`ALLOWED`), by the reducer's method that makes them: a reduction lands
(``EMPTY -> FILLED``, ``ZEROED -> ATTACHED``); the end of backward attaches
(``FILLED -> ATTACHED``); values dropped but views kept (``zero_grad_buffer``, a failed
backward's overwrite discarded: ``FILLED -> EMPTY``, ``ATTACHED -> ZEROED``); everything dropped
(``zero_grad()`` set every ``.grad`` to None, or :mod:`fsdp.optim` zeroed: any ``-> EMPTY``).
A move outside the table is a bug in the reducer: :func:`check_move` raises naming both states.
A reduction in flight (:class:`InFlight`) says what it does to ``main_grad`` when it lands
(:class:`Reduction`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from enum import auto

from dbuffer import Pending
from fsdp.group.state_enum import StateEnum

__all__ = ["ALLOWED", "InFlight", "MainGrad", "MainGradStateError", "Reduction", "check_move"]


class MainGrad(StateEnum):
    """What ``main_grad`` holds, and whether ``.grad`` views it (see the module docstring)."""

    EMPTY = auto()
    FILLED = auto()
    ATTACHED = auto()
    ZEROED = auto()

    @property
    def holds_gradients(self) -> bool:
        """Whether the next reduction accumulates into ``main_grad`` (it holds live gradients)."""
        return self in (MainGrad.FILLED, MainGrad.ATTACHED)

    @property
    def attached(self) -> bool:
        """Whether ``.grad`` / ``.main_grad`` of the parameters are views of ``main_grad``."""
        return self in (MainGrad.ATTACHED, MainGrad.ZEROED)

    def after_reduction(self) -> "MainGrad":
        """The state once a reduction wrote or added into ``main_grad``."""
        return {MainGrad.EMPTY: MainGrad.FILLED, MainGrad.ZEROED: MainGrad.ATTACHED}.get(self, self)

    def without_values(self) -> "MainGrad":
        """The state once the values are dropped and any ``.grad`` views kept."""
        return MainGrad.ZEROED if self.attached else MainGrad.EMPTY


_M = MainGrad

#: ``ALLOWED[current]``: the states ``main_grad`` in ``current`` may enter.
ALLOWED: dict[MainGrad, frozenset[MainGrad]] = {
    _M.EMPTY: frozenset({_M.EMPTY, _M.FILLED}),
    _M.FILLED: frozenset({_M.FILLED, _M.ATTACHED, _M.EMPTY}),
    _M.ATTACHED: frozenset({_M.ATTACHED, _M.ZEROED, _M.EMPTY}),
    _M.ZEROED: frozenset({_M.ZEROED, _M.ATTACHED, _M.EMPTY}),
}


class MainGradStateError(RuntimeError):
    """The reducer asked ``main_grad`` for a move :data:`ALLOWED` refuses."""


def check_move(params: str, current: MainGrad, target: MainGrad) -> MainGrad:
    """``target`` if ``main_grad`` of ``params`` (their names, for the message) may move there
    from ``current``; else raise :class:`MainGradStateError`."""
    if target not in ALLOWED[current]:
        raise MainGradStateError(
            f"main_grad of {params} cannot go from {current.name} to {target.name}; "
            f"from {current.name} it may enter {sorted(s.name for s in ALLOWED[current])}"
        )
    return target


class Reduction(enum.Enum):
    """What a reduction in flight does with its result once it lands."""

    OVERWRITE = "overwrite"  # main_grad held nothing live: the result replaces it
    ACCUMULATE = "accumulate"  # added to main_grad (micro-batches)
    DEFERRED = "deferred"  # HSDP, all-reduce deferred: reduce-scattered sums kept for later


@dataclass
class InFlight:
    pending: Pending
    kind: Reduction
    folded: bool = False  # divided and folded into main_grad at its launch: nothing left to do with it
