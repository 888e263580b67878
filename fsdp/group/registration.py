"""Where a group's parameters are registered on modules (:class:`Registrations`), and a counter
of registrations, which the optimizer step hooks read.

Every time fsdp registers a group's parameters on modules for the first time, or swaps a
parameter object (``to_empty``, adoption of assigned DTensors), an optimizer built earlier may
hold objects fsdp no longer trains. The core only counts; :mod:`fsdp.optim.step_hooks` checks
each optimizer again when the count has moved since its last check.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch.nn as nn

from fsdp.group.members import ParamInfo

__all__ = ["Registrations", "note_registration", "registrations"]

_COUNT = 0


def note_registration() -> None:
    """Parameters were (re)registered on modules: optimizers must be checked again."""
    global _COUNT
    _COUNT += 1


def registrations() -> int:
    """How many registrations :func:`note_registration` has counted in this process."""
    return _COUNT


class Registrations:
    """Every ``(module, name)`` a group's parameters are registered under (tied ones included)
    and what fsdp last put there, checked before each registration: a parameter assigned after
    ``fully_shard`` (``module.weight = nn.Parameter(...)``) would otherwise be silently replaced
    by fsdp's own at the next registration, and never trained or used."""

    def __init__(self, infos: Sequence[ParamInfo]) -> None:
        self.infos = infos
        self._slots = tuple((k, m, name) for k, info in enumerate(infos) for m, name in info.registrations)
        self.registered: Optional[list[nn.Parameter]] = None  # None: the originals are still there

    def put(self, params: list[nn.Parameter], owner: str) -> None:
        """Register ``params`` in place of each parameter; raises, registering nothing, as
        :meth:`check` does (``owner``: the unit's name, for the message)."""
        self.check(owner)
        for info, p in zip(self.infos, params):
            for module, name in info.registrations:
                module._parameters[name] = p
        if self.registered is None:  # fully_shard: optimizers are checked again
            note_registration()
        self.registered = params

    def check(self, owner: str) -> None:
        """Raise ``RuntimeError`` naming the parameter if a module no longer holds what fsdp registered."""
        expected = self.registered
        if expected is None:
            return
        for k, module, name in self._slots:
            if module._parameters.get(name) is not expected[k]:
                self._raise_replaced(k, module, name, owner)

    def _raise_replaced(self, k: int, module: nn.Module, name: str, owner: str) -> None:
        info, have = self.infos[k], module._parameters.get(name)
        alias = "" if (module, name) == info.registrations[0] else f" (tied; its {type(module).__name__}.{name})"
        what = "removed" if have is None else "replaced"
        raise RuntimeError(
            f"parameter {info.fqn!r} of {owner}{alias} was {what} after fully_shard; fsdp "
            f"registers its own sharded parameter there and would silently drop yours. Assign "
            f"parameters before fully_shard, or change the values in place: "
            f"fsdp.checkpoint.set_state_dict(model, model_state_dict={{name: full_tensor}}, "
            f"options=StateDictOptions(full_state_dict=True, strict=False)), or "
            f"fsdp.init_weights(model, fn) with fn copying into the (then full) parameter"
        )
