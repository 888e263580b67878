"""Where a unit is in a training step (:class:`TrainingState`), and which moves between states are legal.

The shape is FSDP2's (``torch.distributed.fsdp._fully_shard._fsdp_common.TrainingState``): four
states per unit, moved by its hooks. fsdp checks every move against :data:`ALLOWED`, so a hook
that fires where the step cannot be (a backward reaching a unit whose forward is still running,
a forward while a unit's backward never finished) raises :class:`TrainingStateError` naming
the unit, its state and the state it was asked to enter, instead of gathering or freeing weights
under the running computation.

The moves, by the hook that makes them (``fsdp.unit.state``):

* pre-forward (outside backward): ``IDLE -> FORWARD``; ``FORWARD -> FORWARD`` for a forward inside
  the unit's own forward (``register_fsdp_forward_method``: ``generate`` calling ``forward``);
* post-forward: ``FORWARD -> IDLE`` (``IDLE -> IDLE`` for the outer call of such a nesting);
* pre-backward (the first gradient of an output, or a forward recomputed inside backward by
  activation checkpointing): ``IDLE | POST_BACKWARD -> PRE_BACKWARD``, and ``PRE_BACKWARD ->
  PRE_BACKWARD`` for a recomputation after the hook (it gathers again if needed);
* a group's gradients complete, reduction launched, weights resharded: ``PRE_BACKWARD | IDLE ->
  POST_BACKWARD`` (``IDLE``: parameters whose gradients arrive before any output gradient reached
  the hook, e.g. outputs it could not see); ``POST_BACKWARD -> PRE_BACKWARD`` when a unit run twice
  gets its outputs' gradients in a second round of the same backward (it gathers again);
* the root's end of backward and ``reset_iter_state``: every state ``-> IDLE``.

Refused: ``FORWARD -> PRE_BACKWARD | POST_BACKWARD`` (the unit's weights would be regathered or
freed under its running forward: a backward inside that forward, or a forward that raised and
was not followed by ``reset_iter_state()``) and ``PRE_BACKWARD | POST_BACKWARD -> FORWARD`` outside
backward (the unit's backward never reached its end: it raised; without ``reset_iter_state()`` the
next backward would lose its end-of-backward callback and never attach its gradients).
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
    PRE_BACKWARD = auto()  # its backward began: weights gathered for it, the unit before it prefetched
    POST_BACKWARD = auto()  # a group's gradients went to reduction and its weights were resharded


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
    """Raise :class:`TrainingStateError` if a unit (named ``unit``) in ``current`` may not enter
    ``target``."""
    if target not in ALLOWED[current]:
        raise TrainingStateError(
            f"fsdp unit {unit} cannot go from {current.name} to {target.name}: {_WHY[current]}"
        )


def in_backward() -> bool:
    """Whether this thread is running autograd's backward: a forward there is activation
    checkpointing's recomputation (``torch.utils.checkpoint``, reentrant or not, HF's
    ``gradient_checkpointing``), not a new step; ``finalize_backward`` there is too early."""
    return torch._C._current_graph_task_id() != -1
