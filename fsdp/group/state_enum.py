"""The base of fsdp's state machines' enums: members hashed by identity (``object.__hash__``, in
C, not ``Enum.__hash__``'s Python call), as every hook looks its move up in an ``ALLOWED`` table.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["StateEnum"]


class StateEnum(Enum):
    """An :class:`~enum.Enum` whose members hash by identity (a descriptor: not a member)."""

    __hash__ = object.__hash__
