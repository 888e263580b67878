"""ReadWatch: finds, at the first forward, which units' parameters a later unit's forward reads.

megatron-core's tied output layer reads ``embedding.word_embeddings.weight`` after the embedding
unit's forward ended, when a resharded unit has its sharded DTensor registered: the reader would
compute with it (FSDP2 fails there) and its backward would read freed weights.

So during the root's first forward only, each module holding a parameter of a unit whose forward
ended gets a ``_parameters`` dict that sees reads by name (not iteration, state dicts or fsdp's
checks). A forward read makes the unit gather back (every rank runs the same code) and from then on
keep its weights until backward ends, as ``reshard_after_forward=False``; then the modules get their
own dicts back, so the hot path watches nothing. The owner keeps the weight rather than the reader
gathering again: it is needed from the reader to the owner's backward anyway, so this adds it only
to forward's lower-memory part, with no second gather or buffer per reader.

Not seen: a read before the owner's forward (the reader gets the sharded DTensor and raises, as in
FSDP2) or outside the root's forward (a loss); a metadata-only read still keeps the owner gathered.
A parameter *registered* in two units is refused at lazy init (as FSDP2), naming this way out:
register it on one module and hand it to the other.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn as nn

from fsdp.unit.training_state import TrainingState, in_backward

if TYPE_CHECKING:
    from fsdp.unit.root import Unit

__all__ = ["ReadWatch"]

logger = logging.getLogger("fsdp")


def _eager(fn):
    """``fn`` called, never traced, by torch.compile (as :func:`fsdp.unit.state._run_eagerly`)."""
    return torch.compiler.disable(fn, recursive=True, reason="fsdp's read watch gathers and registers parameters")


class _WatchedParameters(dict):
    """A module's ``_parameters`` while the watch is on: a read by name asks the watch."""

    __slots__ = ("watch",)

    def __getitem__(self, name: str) -> Optional[nn.Parameter]:
        return self.watch.read(self, name)


class ReadWatch:
    """Watches, during the root's first forward, reads of the parameters of the units below it,
    each unit's from the end of its forward (a hook after fsdp's); stops when it returns."""

    def __init__(self, root: Unit, units: list[Unit]) -> None:
        self.root = root
        self.read = _eager(self._read)  # what a watched dict's reads call
        self.owners: dict[int, tuple[Unit, str]] = {}  # sharded parameter -> (its unit, its name)
        self.modules: dict[int, list[nn.Module]] = {}  # unit -> the modules holding its parameters
        self.originals: dict[nn.Module, dict] = {}  # a watched module -> its own _parameters
        self._handles = []
        for unit in units:
            if unit is root:  # its weights stay gathered through its own forward
                continue
            holders: dict[int, nn.Module] = {}
            for group in unit.groups:
                for info, param in zip(group.infos, group.sharded_params):
                    self.owners[id(param)] = (unit, f"{unit.fqn}.{info.fqn}" if unit.fqn else info.fqn)
                    holders.update((id(m), m) for m, _ in info.registrations)
            if holders:
                self.modules[id(unit)] = list(holders.values())
                for module in unit.modules:
                    self._handles.append(module.register_forward_hook(_eager(self._unit_forward_ended(unit))))
        if self._handles:
            self._handles.append(root.modules[0].register_forward_hook(_eager(self._stop)))

    def _unit_forward_ended(self, unit: Unit):
        def watch(module: nn.Module, args: tuple, output: object) -> None:
            for holder in self.modules.get(id(unit), ()):
                if holder not in self.originals:
                    watched = _WatchedParameters(holder._parameters)
                    watched.watch = self
                    self.originals[holder] = holder._parameters
                    holder.__dict__["_parameters"] = watched

        return watch

    def _read(self, parameters: dict, name: str) -> Optional[nn.Parameter]:
        """``parameters[name]``, its unit gathered back first if read after the unit's forward."""
        value = dict.__getitem__(parameters, name)
        owner = self.owners.get(id(value))
        if owner is None or in_backward():
            return value
        unit, fqn = owner
        ctx = self.root.root_ctx
        if unit.training_state is not TrainingState.IDLE or unit.registered_unsharded:
            return value
        reader = next((u for u in reversed(ctx.forward_order) if u.training_state is TrainingState.FORWARD), self.root)
        read = f"{fqn!r} is read in the forward of {reader.name()}"
        if read not in unit.read_after_forward:  # from now on its post-forward keeps its weights
            unit.read_after_forward.append(read)
            logger.debug("%s keeps its weights after forward: %s", unit.name(), read)
        unit.unshard()  # once: back for the reader, as a kept unit has them
        unit.register_unsharded_params()
        return dict.__getitem__(parameters, name)

    def _stop(self, module: nn.Module, args: tuple, output: object) -> None:
        """The root's first forward returned: give each watched module its own dict back."""
        for holder, original in self.originals.items():
            watched = holder.__dict__["_parameters"]
            original.clear()
            original.update(dict.items(watched))
            holder.__dict__["_parameters"] = original
        self.originals = {}
        for handle in self._handles:
            handle.remove()
        self._handles = []
