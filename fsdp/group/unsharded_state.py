"""The life of a group's unsharded weights (:class:`Unsharded`), tracked per group (FSDP2: per
parameter), where gathers happen:

* ``SHARDED``: no unsharded weights: using them needs a gather.
* ``GATHERING``: a gather into them is in flight.
* ``GATHERED``: they hold refresh :attr:`UnshardedLife.version`. ZeRO-0/1/2 stay here.
* ``SLICE_KEPT``: freed after forward, a ``1/n`` slice kept (:mod:`fsdp.compose.post_forward`).
* ``FORWARD_ONLY_FREED``: forward-only parameters freed (:mod:`fsdp.group.forward_only`): enough
  for backward, not for another forward.

The moves (:data:`ALLOWED`): a gather, a reshard or a rebuild may start from any state but
``GATHERING`` (a rebuild waits for it first).
"""

from __future__ import annotations

from enum import auto
from typing import Optional

from fsdp.group.state_enum import StateEnum

__all__ = ["ALLOWED", "Unsharded", "UnshardedLife", "UnshardedStateError"]


class Unsharded(StateEnum):
    """Where a group's unsharded weights are (see :mod:`~fsdp.group.unsharded_state`)."""

    SHARDED = auto()
    GATHERING = auto()
    GATHERED = auto()
    SLICE_KEPT = auto()
    FORWARD_ONLY_FREED = auto()


_U = Unsharded

#: ``ALLOWED[current]``: the states the unsharded weights in ``current`` may enter.
ALLOWED: dict[Unsharded, frozenset[Unsharded]] = {
    _U.SHARDED: frozenset({_U.SHARDED, _U.GATHERING}),
    _U.GATHERING: frozenset({_U.GATHERED}),
    _U.GATHERED: frozenset({_U.GATHERING, _U.SLICE_KEPT, _U.FORWARD_ONLY_FREED, _U.SHARDED}),
    _U.SLICE_KEPT: frozenset({_U.GATHERING, _U.SHARDED}),
    _U.FORWARD_ONLY_FREED: frozenset({_U.GATHERING, _U.SHARDED}),
}


class UnshardedStateError(RuntimeError):
    """A move :data:`ALLOWED` refuses: a bug in the group's cycle."""


class UnshardedLife:
    """One group's :class:`Unsharded` state and refresh; ``names`` are for error messages."""

    def __init__(self, names: str) -> None:
        self._names = names
        self.state = Unsharded.SHARDED
        self.version: Optional[int] = None

    def is_current(self, refresh: int) -> bool:
        """Whether the unsharded weights hold the main weights of ``refresh``."""
        return self.state is Unsharded.GATHERED and self.version == refresh

    def begin_gather(self) -> None:
        self._move(Unsharded.GATHERING)

    def gathered(self, refresh: int) -> None:
        """The gather landed: the weights hold refresh ``refresh``."""
        self._move(Unsharded.GATHERED)
        self.version = refresh

    def keep_slice(self) -> None:
        """Freed after forward, a slice of the same version kept."""
        self._move(Unsharded.SLICE_KEPT)

    def free_forward_only(self) -> None:
        """After forward, the parameters only forward reads were freed; the rest is kept."""
        self._move(Unsharded.FORWARD_ONLY_FREED)

    def freed(self) -> None:
        self._move(Unsharded.SHARDED)
        self.version = None

    def _move(self, target: Unsharded) -> None:
        if target not in ALLOWED[self.state]:
            raise UnshardedStateError(
                f"the unsharded weights of {self._names} cannot go from {self.state.name} to "
                f"{target.name}; from {self.state.name} they may enter {sorted(s.name for s in ALLOWED[self.state])}"
            )
        self.state = target
