"""Lazy initialisation: the first unit to run forward finds the tree of units below it.

As in FSDP2, that unit becomes their root: it collects them (``named_modules`` order), checks what
must hold before any gather, adopts parameters assigned since ``fully_shard`` and builds the tree's
:class:`~fsdp.unit.root.RootContext`. In its first forward :mod:`fsdp.unit.read_watch` finds units
whose parameters a later unit's forward reads: they keep their weights for that reader.
"""

from __future__ import annotations

import logging

from fsdp.group.meta_init import adopt_assigned
from fsdp.group.members import meta_error
from fsdp.unit.read_watch import ReadWatch
from fsdp.unit.root import MAX_REDUCTIONS_IN_FLIGHT, RootContext, Unit

__all__ = ["find_tree"]

logger = logging.getLogger("fsdp")


def find_tree(root: Unit) -> None:
    """Make ``root`` the root of every unit below its module. Raises ``RuntimeError`` for a unit
    below it that ran forward first, parameters still on the meta device, or manual backward
    finalization set below the root; ``ValueError`` for a parameter tied across two units."""
    unit_type = type(root)
    units: dict[Unit, str] = {}
    for name, m in root.modules[0].named_modules():
        state = getattr(m, "_fsdp_state", None)
        if not isinstance(state, unit_type) or state in units:
            continue
        if state is not root and state.root is not None:
            raise RuntimeError(
                f"FSDP state has already been lazily initialized for {name}\nFSDP requires running "
                f"forward through the root module first"
            )
        units[state] = name
    shared = [message for state in units for message in state.shared_with_other_units]
    if shared:  # local and identical on every rank (same model): raised before any collective
        raise ValueError(shared[0])
    for state in units:
        for group in state.groups:
            adopt_assigned(group)
    names = {id(p): n for top in root.modules for n, p in top.named_parameters(remove_duplicate=False)}
    for state in units:
        on_meta = [p for g in state.groups if g.is_meta for p in g.sharded_params]
        if on_meta:
            raise RuntimeError(meta_error([names.get(id(p), "?") for p in on_meta]))
    # Knobs set early (root_knobs): the root's stay; the largest reduction bound asked for wins.
    early = [state.root_ctx for state in units if state.root_ctx is not None]
    if any(state is not root and state.root_ctx is not None and state.root_ctx.manual_finalization for state in units):
        raise RuntimeError("set_manual_backward_finalization must be called on the root FSDP module")
    ctx = root.root_ctx if root.root_ctx is not None else RootContext([root])
    ctx.max_reductions_in_flight = max((c.max_reductions_in_flight for c in early), default=MAX_REDUCTIONS_IN_FLIGHT)
    for state, name in units.items():
        state.root, state.fqn, state.root_ctx = root, name, None
        for group in state.groups:  # what a failed collective names (dbuffer.calls)
            group.call_label.text = f"fsdp unit {state.name()}"
    root.root_ctx = ctx
    ctx.take_tree(list(units))
    ReadWatch(root, list(units))  # until the root's first forward returns
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug(
            "lazy init: root %s of %d units %s; %d parameter groups on %s",
            root.name(), len(units), [state.fqn or "<root>" for state in units],
            sum(len(state.groups) for state in units), sorted({str(s.device) for s in ctx.streams}),
        )
