"""Where a unit is in a training step (:class:`TrainingState`), and which moves are legal.

The states are FSDP2's, moved by the unit's hooks and checked against :data:`ALLOWED`: a hook
firing where the step cannot be raises :class:`TrainingStateError` instead of gathering or freeing
weights under the running computation. Less obvious moves: ``FORWARD -> FORWARD`` (a nested
forward), ``PRE_BACKWARD -> PRE_BACKWARD`` (activation checkpointing's recomputation),
``POST_BACKWARD -> PRE_BACKWARD`` (a unit run twice), ``IDLE -> POST_BACKWARD`` (gradients before
any output gradient reached the hook). Refused: ``FORWARD -> *_BACKWARD`` (weights regathered or
freed under a running forward) and ``*_BACKWARD -> FORWARD`` (a backward raised: the next would
lose its end-of-backward callback); ``reset_iter_state()`` recovers.
"""

from __future__ import annotations

from enum import auto

import torch

from fsdp.group.state_enum import StateEnum

__all__ = ["ALLOWED", "TrainingState", "TrainingStateError", "check_transition", "in_backward"]


class TrainingState(StateEnum):
    """One unit's place in a step."""

    IDLE = auto()  # between steps, between a forward and its backward
    FORWARD = auto()  # between the unit's pre-forward and post-forward hooks (outside backward)
    PRE_BACKWARD = auto()  # its backward began: weights gathered, the previous unit prefetched
    POST_BACKWARD = auto()  # a group's gradients went to reduction, its weights resharded


_S = TrainingState

#: ``ALLOWED[current]``: the states a unit in ``current`` may enter (see the module docstring).
ALLOWED: dict[TrainingState, frozenset[TrainingState]] = {
    _S.IDLE: frozenset({_S.IDLE, _S.FORWARD, _S.PRE_BACKWARD, _S.POST_BACKWARD}),
    _S.FORWARD: frozenset({_S.FORWARD, _S.IDLE}),
    _S.PRE_BACKWARD: frozenset({_S.PRE_BACKWARD, _S.POST_BACKWARD, _S.IDLE}),
    _S.POST_BACKWARD: frozenset({_S.POST_BACKWARD, _S.PRE_BACKWARD, _S.IDLE}),
}

_WHY = {
    _S.FORWARD: (
        "a backward reached this unit while its forward is still running (a backward inside its "
        "forward, or a forward that raised without reset_iter_state() on the root afterwards); its "
        "weights would be gathered or freed under that forward. Run backward after the forward "
        "returns; after a failed forward call reset_iter_state() on the root module"
    ),
    _S.PRE_BACKWARD: (
        "its backward has not reached its end (a backward raised?). Call reset_iter_state() on the "
        "root module after a failed backward, before the next forward"
    ),
}
_WHY[_S.POST_BACKWARD] = _WHY[_S.PRE_BACKWARD]


class TrainingStateError(RuntimeError):
    """A hook asked a unit for a move :data:`ALLOWED` refuses."""


def check_transition(unit: str, current: TrainingState, target: TrainingState) -> None:
    """Raise :class:`TrainingStateError` if ``unit``, in ``current``, may not enter ``target``."""
    if target not in ALLOWED[current]:
        raise TrainingStateError(
            f"fsdp unit {unit} cannot go from {current.name} to {target.name}: {_WHY[current]}"
        )


def in_backward() -> bool:
    """Whether this thread runs backward: a forward there is a recomputation, not a new step."""
    return torch._C._current_graph_task_id() != -1
