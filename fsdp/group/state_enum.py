"""The base of fsdp's state machines' enums: members hashed by identity.

Every hook of every unit checks its move against an ``ALLOWED`` table (a dict of frozensets keyed
by members), several times per unit per step. ``Enum.__hash__`` is a Python function (it hashes
the member's name); members are singletons compared by identity, so ``object.__hash__`` (in C)
is as correct and costs no Python call.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["StateEnum"]


class StateEnum(Enum):
    """An :class:`~enum.Enum` whose members hash by identity (a descriptor: not a member)."""

    __hash__ = object.__hash__
