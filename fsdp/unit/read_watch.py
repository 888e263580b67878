"""ReadWatch: which units' parameters another unit's forward reads after theirs, found at the first forward.

A parameter may belong to one unit and be read by another unit's forward after the owner's
forward ended. megatron-core ties its output layer to the embedding this way (the default,
``share_embeddings_and_output_weights=True``): the embedding unit owns
``embedding.word_embeddings.weight``, and the root's forward hands it to the output layer
(``GPTModel.shared_embedding_or_output_weight()``, ``output_layer(hidden, weight=...)``). Resharded
after its forward, the owner has its sharded DTensor registered there by then: the reader would
compute with it (FSDP2 fails there, ``aten.mm.default got mixed torch.Tensor and DTensor``), and
its backward would read the freed weights.

Nothing before the first forward says who reads what, so the root watches during its first
forward only. When a unit's forward ends there, each module holding one of its parameters gets a
``_parameters`` dict that sees reads by name (``module.weight`` goes through
``nn.Module.__getattr__`` to it; registration, iteration, state dicts and fsdp's own checks do
not). A read of the unit's sharded parameter then, in forward, makes the unit keep its weights
for the reader (its ``read_after_forward`` names what was read and by whom): it gathers them
back for this read (every rank runs the same code, so every rank makes the same collective at
the same read) and from then on keeps them gathered and registered after its forward until its
backward ends, as ``reshard_after_forward=False`` does. When the root's first forward returns,
each module gets its own dict object back, holding what is registered then: the decision is data
on the unit, the hot path watches nothing, and what a compiled forward saw (and guards on) before
is what it sees after.

Why the owner keeps them rather than the reader gathering them again: the reader runs at the end
of forward (the output layer) and its backward first, so the weight is needed from there to the
owner's backward either way, which is the step's memory peak (all activations live); keeping it
from the owner's forward adds it only to the earlier, lower part of the forward, and costs no
second gather or a place to gather into per reader.

What the watch does not see, and what then happens: a read before the owner's forward in that
step (nothing is gathered yet; the reader gets the sharded DTensor as before: its metadata is
right, computing with it raises DTensor's error, as in FSDP2); a read outside the root's forward
(a loss computed after it); a read made only for metadata (``weight.dtype``) after the owner's
forward still keeps the owner gathered. A parameter *registered* on modules of two units is
refused at lazy initialisation, as in FSDP2 (``fully_shard``'s "already managed by another FSDP
unit"), naming the way out this watch allows: register it on one module and hand it to the other.
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
    """``fn`` called as it is by torch.compile, never traced: it gathers and registers (as fsdp's
    own hooks are marked, :func:`fsdp.unit.state._run_eagerly`)."""
    return torch.compiler.disable(fn, recursive=True, reason="fsdp's read watch gathers and registers parameters")


class _WatchedParameters(dict):
    """A module's ``_parameters`` while the watch is on: a read by name asks the watch."""

    __slots__ = ("watch",)

    def __getitem__(self, name: str) -> Optional[nn.Parameter]:
        return self.watch.read(self, name)


class ReadWatch:
    """Watches, during the root's first forward, reads of the parameters of the units below it
    (see the module docstring), each unit's from the end of its forward (a forward hook after
    fsdp's, which has registered the sharded parameters by then); stops itself when that forward
    returns."""

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
        """``parameters[name]``, after gathering its unit back if another unit's forward reads
        it after the unit's forward ended."""
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
        unit.unshard()  # this once (the first forward): back for the reader, as a kept unit has them
        unit.register_unsharded_params()
        return dict.__getitem__(parameters, name)

    def _stop(self, module: nn.Module, args: tuple, output: object) -> None:
        """The root's first forward returned: every watched module gets its own dict back,
        holding what is registered now."""
        for holder, original in self.originals.items():
            watched = holder.__dict__["_parameters"]
            original.clear()
            original.update(dict.items(watched))
            holder.__dict__["_parameters"] = original
        self.originals = {}
        for handle in self._handles:
            handle.remove()
        self._handles = []
