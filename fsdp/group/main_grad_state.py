"""What a group's ``main_grad`` holds and whether ``.grad`` views it (:class:`MainGrad`): whether
the next reduction *accumulates* or *overwrites*, and whether the storage must stay.

* ``EMPTY``: nothing live; ``.grad`` not ours. Its storage may be released.
* ``FILLED``: a reduction wrote gradients; the end of backward attaches them.
* ``ATTACHED``: gradients live and ``.grad`` points at them.
* ``ZEROED``: ``.grad`` still views the buffer, zeroed: the next reduction overwrites.

A move outside :data:`ALLOWED` is a reducer bug: :func:`check_move` raises.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from enum import auto

from dbuffer import Pending
from fsdp.group.state_enum import StateEnum

__all__ = ["ALLOWED", "InFlight", "MainGrad", "MainGradStateError", "Reduction", "check_move"]


class MainGrad(StateEnum):
    """What ``main_grad`` holds and whether ``.grad`` views it (see the module docstring)."""

    EMPTY = auto()
    FILLED = auto()
    ATTACHED = auto()
    ZEROED = auto()

    @property
    def holds_gradients(self) -> bool:
        """Whether the next reduction accumulates into ``main_grad``."""
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
    """``target`` if :data:`ALLOWED` from ``current``; else raises :class:`MainGradStateError`."""
    if target not in ALLOWED[current]:
        raise MainGradStateError(
            f"main_grad of {params} cannot go from {current.name} to {target.name}; "
            f"from {current.name} it may enter {sorted(s.name for s in ALLOWED[current])}"
        )
    return target


class Reduction(enum.Enum):
    """What a reduction in flight does with its result once it lands."""

    OVERWRITE = "overwrite"
    ACCUMULATE = "accumulate"
    DEFERRED = "deferred"  # HSDP, all-reduce deferred: reduce-scattered sums kept for later


@dataclass
class InFlight:
    """A reduction in flight, and what it does to ``main_grad`` when it lands."""

    pending: Pending
    kind: Reduction
    folded: bool = False  # divided and folded into main_grad at its launch: nothing left to do with it
