"""FSDP2's private state as ``torch.distributed.pipelining`` of torch 2.11 to 2.14 reads it.

Before torch 2.15's ``finalize_backward``, a pipeline stage whose module is an ``FSDPModule`` ends
the step's backward (``perform_reduce_grad``) through FSDP2's internals: on
``fully_shard.state(stage_module)`` it calls ``post_backward()`` on each group of each unit's
``_fsdp_param_groups`` (torch 2.11: ``_fsdp_param_group``) in ``_state_ctx.all_states``, then
``_root_post_backward_final_callback()``. :class:`~fsdp.unit.state.FSDPState` answers those names,
and no others, with the views below.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from fsdp.unit.root import Unit

__all__ = ["FSDP2Names", "PostBackward", "TreeView"]


class TreeView:
    """``state._state_ctx``: the tree's units as ``all_states`` (just the unit before lazy init)."""

    def __init__(self, unit: Unit) -> None:
        self._unit = unit

    @property
    def all_states(self) -> list[Unit]:
        root = self._unit.root if self._unit.root is not None else self._unit
        return list(root.root_ctx.units) if root.root_ctx is not None else [root]


class PostBackward:
    """One unit as a schedule calls FSDP2's ``FSDPParamGroup``: its :meth:`post_backward`."""

    def __init__(self, unit: Unit) -> None:
        self._unit = unit

    def post_backward(self) -> None:
        """Take the gradients the schedule left on the unsharded parameters, launch the
        unit's reductions if it syncs, and reshard it if ``reshard_after_backward``."""
        unit = self._unit
        for group in unit.groups:
            if group.grads is None:
                continue
            group.grads.take_assigned_grads()
            if unit.requires_grad_sync:
                group.grads.launch_reduce()
        if unit.reshard_after_backward:
            unit.reshard()


class FSDP2Names:
    """The names these schedules read on a stage's FSDP2 state, for
    :class:`~fsdp.unit.state.FSDPState` to inherit (``self``: a :class:`~fsdp.unit.root.Unit`)."""

    @property
    def _state_ctx(self: Unit) -> TreeView:
        return TreeView(self)

    @property
    def _fsdp_param_groups(self: Unit) -> list[PostBackward]:
        return [PostBackward(self)] if self.groups else []

    @property
    def _fsdp_param_group(self: Unit) -> Optional[PostBackward]:  # torch 2.11's name
        return PostBackward(self) if self.groups else None

    def _root_post_backward_final_callback(self: Unit) -> None:
        (self.root if self.root is not None else self)._final_callback()
