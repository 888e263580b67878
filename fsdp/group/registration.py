"""Where a group's parameters are registered (:class:`Registrations`), and a counter of
(re)registrations: :mod:`fsdp.optim.step_hooks` checks optimizers again when it moved.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

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
    """Every ``(module, name)`` the parameters of ``infos`` are registered under, checked before
    each registration against fsdp's last: a parameter assigned after ``fully_shard`` would
    otherwise be silently replaced and never trained."""

    def __init__(self, infos: Sequence[ParamInfo]) -> None:
        self.infos = infos
        self._slots = tuple((k, m, name) for k, info in enumerate(infos) for m, name in info.registrations)

    def put(self, params: list[nn.Parameter], last: Optional[list[nn.Parameter]], owner: Callable[[], str]) -> None:
        """Register ``params`` in place of ``last`` (None: at ``fully_shard``); raises, registering
        nothing, as :meth:`check` does (``owner()`` names the unit)."""
        for j, (k, module, name) in enumerate(self._slots):  # check() and registration in one pass
            registered = module._parameters
            if last is not None and registered.get(name) is not last[k]:
                for k_done, module_done, name_done in self._slots[:j]:  # put back: register nothing
                    module_done._parameters[name_done] = last[k_done]
                self._raise_replaced(k, module, name, owner)
            registered[name] = params[k]
        if last is None:  # fully_shard: optimizers are checked again
            note_registration()

    def check(self, last: Optional[list[nn.Parameter]], owner: Callable[[], str]) -> None:
        """Raise ``RuntimeError`` naming the parameter if a module no longer holds ``last``'s."""
        if last is None:
            return
        for k, module, name in self._slots:
            if module._parameters.get(name) is not last[k]:
                self._raise_replaced(k, module, name, owner)

    def _raise_replaced(self, k: int, module: nn.Module, name: str, owner: Callable[[], str]) -> None:
        info, have = self.infos[k], module._parameters.get(name)
        alias = "" if (module, name) == info.registrations[0] else f" (tied; its {type(module).__name__}.{name})"
        what = "removed" if have is None else "replaced"
        raise RuntimeError(
            f"parameter {info.fqn!r} of {owner()}{alias} was {what} after fully_shard; fsdp "
            f"registers its own sharded parameter there and would silently drop yours. Assign "
            f"parameters before fully_shard, or change the values in place: "
            f"fsdp.checkpoint.set_state_dict(model, model_state_dict={{name: full_tensor}}, "
            f"options=StateDictOptions(full_state_dict=True, strict=False)), or "
            f"fsdp.init_weights(model, fn) with fn copying into the (then full) parameter"
        )
