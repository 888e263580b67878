"""The life of a group's unsharded (model-dtype, full) weights between the optimizer's steps
(:class:`Unsharded`), with the moves checked and the main weights' version they were made from.

FSDP2 tracks this per parameter (``ShardedState``: sharded, unsharded, sharded post-forward);
fsdp tracks it per group, where the gathers happen, and adds the gather in flight:

* ``SHARDED``: no unsharded weights (ZeRO-3 between uses): using them needs a gather.
* ``GATHERING``: a gather into them is in flight (a prefetch, or an ``unshard(async_op=True)``).
* ``GATHERED``: they hold the main weights of refresh :attr:`UnshardedLife.version`; current
  while no refresh came since. ZeRO-0/1/2 keep them here between steps.
* ``SLICE_KEPT``: freed after forward, a ``1/n`` slice of them kept for backward's gather
  (``reshard_after_forward=n``, :mod:`fsdp.compose.post_forward`).
* ``FORWARD_ONLY_FREED``: kept after forward but for the parameters only forward reads, freed
  (:mod:`fsdp.group.forward_only`): enough for backward, not for another forward.

The moves (:data:`ALLOWED`): a gather starts from any state but ``GATHERING`` (``GATHERED``: the
optimizer stepped since), lands in ``GATHERED``; after forward, ``GATHERED -> SLICE_KEPT``,
``-> FORWARD_ONLY_FREED`` or ``-> SHARDED``; a reshard or a rebuild of the buffers
(``module.to``, ``to_empty``) returns to ``SHARDED`` from any state but ``GATHERING`` (waited for
first).
"""

from __future__ import annotations

from enum import auto
from typing import Optional

from fsdp.group.state_enum import StateEnum

__all__ = ["ALLOWED", "Unsharded", "UnshardedLife", "UnshardedStateError"]


class Unsharded(StateEnum):
    """Where a group's unsharded weights are in their life (see the module docstring)."""

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
    """One group's :class:`Unsharded` state and the refresh its weights (or kept slice) hold.
    ``names``: the group's parameter names, for an error message."""

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
