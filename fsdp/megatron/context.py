"""Megatron-FSDP's ``fully_shard_context`` and ``microbatch``: the units built together, and
whether the current micro-batch is the last of a step.

A context collects the units ``fully_shard`` builds inside it; leaving it finalises them: the
units no other unit contains are the roots (each gets its name, ``""``, and its units theirs,
relative to it), and no forward may run before (``RuntimeError``, as in Megatron-FSDP). fsdp
itself needs no context to train (the first unit run forward becomes the root of those below
it, as in FSDP2), so ``fully_shard`` outside one (megatron-fsdp 0.6.1's spelling) gives the unit
a context of its own, finalised at once.

``microbatch(context, is_last)`` sets ``context.is_last_microbatch`` for its block; setting it
tells every unit of the context what to hold back on a micro-batch that is not the last (the
reductions its ``Partial`` gradient placements defer, :class:`~fsdp.megatron.strategy.Deferral`),
through fsdp's FSDP2 setters: ``set_requires_all_reduce`` (HSDP, HFSDP) or
``set_requires_gradient_sync`` (a ``Partial`` gradient on the shard axis).
"""

from __future__ import annotations

import contextlib
import weakref
from contextvars import ContextVar
from typing import Iterator, Optional, Union

import torch
import torch.nn as nn

__all__ = ["FsdpContext", "current_context", "fully_shard_context", "microbatch"]

_CURRENT: ContextVar[Optional["FsdpContext"]] = ContextVar("fsdp_megatron_context", default=None)


class FsdpContext:
    """The units built in one ``fully_shard_context`` (see the module docstring). ``device``:
    where they compute (None: each unit's mesh device); ``use_symmetric_memory``: their
    collectives' buffers come from torch's symmetric-memory pool (fsdp's
    ``set_symm_mem_for_comm``: CUDA and NCCL only); ``unify_communication_stream``: accepted
    for Megatron-FSDP's signature; fsdp already orders every gather and reduction of a device
    on its two shared streams (:mod:`fsdp.group.streams`).

    Built by :func:`fully_shard_context` (or by ``fully_shard`` for a unit built outside one);
    :meth:`register_module` after :meth:`finalize`, a second :meth:`finalize`, and
    :meth:`ensure_finalized` before it raise ``RuntimeError``; a non-bool
    ``is_last_microbatch`` raises ``TypeError``."""

    implicit = False  # True: built by a fully_shard outside any fully_shard_context, for itself

    def __init__(
        self,
        device: Optional[torch.device] = None,
        use_symmetric_memory: bool = False,
        unify_communication_stream: bool = False,
    ) -> None:
        self.device = device
        self.use_symmetric_memory = use_symmetric_memory
        self.unify_communication_stream = unify_communication_stream
        self._units: list[weakref.ref] = []
        self._is_last = True
        self._finalized = False
        self.roots: tuple = ()

    @classmethod
    def for_one_unit(cls) -> "FsdpContext":
        """The context of a unit ``fully_shard`` builds outside any ``fully_shard_context``
        (megatron-fsdp 0.6.1's usage): its own, finalised as soon as the unit is built."""
        context = cls()
        context.implicit = True
        return context

    def units(self) -> list[nn.Module]:
        """The units of this context still alive, in the order they were built."""
        return [u for u in (r() for r in self._units) if u is not None]

    def register_module(self, module: nn.Module) -> None:
        """Add a unit built in this context (``RuntimeError`` once finalised)."""
        if self._finalized:
            raise RuntimeError("cannot register an FSDP module after its fully_shard_context was left")
        self._units.append(weakref.ref(module))
        module._apply_microbatch(self._is_last)

    def finalize(self) -> None:
        """Name the roots and their units (see the module docstring); ``RuntimeError`` if done."""
        if self._finalized:
            raise RuntimeError("this FSDP context is already finalized")
        units = self.units()
        inside = {id(c) for u in units for c in u.modules() if c is not u and _context_of(c) is not None}
        self.roots = tuple(u for u in units if id(u) not in inside)
        for root in self.roots:
            for name, m in root.named_modules():
                if _context_of(m) is self:
                    m._name = name
            root._is_root = True
        self._finalized = True

    def ensure_finalized(self) -> None:
        """``RuntimeError`` while the context is still being built (inside its ``with`` block)."""
        if not self._finalized:
            raise RuntimeError("FSDP context is not finalized: leave fully_shard_context before running forward")

    @property
    def is_last_microbatch(self) -> bool:
        """Whether the current micro-batch is the last of its step (True by default): units
        finish their reductions only then."""
        return self._is_last

    @is_last_microbatch.setter
    def is_last_microbatch(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"is_last_microbatch must be a bool, got {value!r}")
        self._is_last = value
        for unit in self.units():
            unit._apply_microbatch(value)


def _context_of(module: nn.Module) -> Optional[FsdpContext]:
    """The context of a unit :func:`fsdp.megatron.fully_shard` built (None for other modules)."""
    return module.__dict__.get("_mfsdp_context")


def current_context() -> Optional[FsdpContext]:
    """The ``fully_shard_context`` being built in this thread, if any."""
    return _CURRENT.get()


@contextlib.contextmanager
def fully_shard_context(
    device: Optional[Union[torch.device, str]] = None,
    *,
    use_symmetric_memory: bool = False,
    unify_communication_stream: bool = False,
) -> Iterator[FsdpContext]:
    """Build units together: every ``fully_shard`` inside the block joins the context yielded,
    finalised when the block ends without an exception (see the module docstring). Not
    nestable (``RuntimeError``). ``device``: where the units compute; a unit whose mesh is for
    another device type raises ``ValueError`` at its ``fully_shard``. Megatron-FSDP requires a
    CUDA device; fsdp runs on any device its mesh is for. ``use_symmetric_memory``: the units'
    collectives use torch's symmetric-memory buffers (CUDA and NCCL only: elsewhere
    ``fully_shard`` raises fsdp's ``RuntimeError``). ``unify_communication_stream``: accepted
    for Megatron-FSDP's signature; fsdp already orders a device's gathers and reductions on its
    two shared streams."""
    if _CURRENT.get() is not None:
        raise RuntimeError("fully_shard_context does not support nesting")
    context = FsdpContext(
        None if device is None else torch.device(device),
        use_symmetric_memory=use_symmetric_memory,
        unify_communication_stream=unify_communication_stream,
    )
    token = _CURRENT.set(context)
    try:
        yield context
    except BaseException:
        raise
    else:
        context.finalize()
    finally:
        _CURRENT.reset(token)


@contextlib.contextmanager
def microbatch(context: Union[FsdpContext, nn.Module], is_last: bool) -> Iterator[None]:
    """Within the block, ``context.is_last_microbatch`` is ``is_last`` (restored after). Takes
    the context (Megatron-LM main) or a module, whose units' contexts it sets (megatron-fsdp
    0.6.1). ``RuntimeError`` for a context still being built, ``TypeError`` for anything else."""
    if isinstance(context, FsdpContext):
        contexts = [context]
    elif isinstance(context, nn.Module):
        found = (_context_of(m) for m in context.modules())
        contexts = list({id(c): c for c in found if c is not None}.values())
    else:
        raise TypeError(f"microbatch expects the FsdpContext of fully_shard_context (or a module), got {type(context).__name__}")
    for c in contexts:
        c.ensure_finalized()
    before = [(c, c.is_last_microbatch) for c in contexts]
    for c in contexts:
        c.is_last_microbatch = bool(is_last)
    try:
        yield
    finally:
        for c, value in before:
            c.is_last_microbatch = value
