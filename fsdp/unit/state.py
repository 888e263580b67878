"""FSDPState: one unit's hooks around forward and backward, prefetching, and the end of backward.

A ZeRO-3 step per unit (other strategies skip gathers and frees), with the
:class:`~fsdp.unit.training_state.TrainingState` each hook leaves:

1. forward pre-hook (FORWARD): refresh stale weights, gather, register the unsharded parameters,
   prefetch the next unit;
2. post-hook (IDLE): units that reshard (not the root, whose backward is next, nor one whose
   weights a later forward reads, :mod:`fsdp.unit.read_watch`) register the sharded parameters and
   free the unsharded storage; others keep them (under ``no_grad`` too) until step 5 or
   ``reshard()``. Outputs are hooked for step 3;
3. pre-backward (PRE_BACKWARD; first output gradient): gather again, prefetch the unit before;
4. gradient hooks: a group's first finishes the reduction in flight, its last frees the
   unsharded storage (POST_BACKWARD), then copies them into ``grad_in`` (allocated only then, as
   FSDP2) and launches its reduction (at most one in flight);
5. the root's final autograd callback (IDLE) reduces what is left, reshards, waits for every
   reduction and attaches ``param.grad`` (manual finalization: :meth:`fsdp.FSDPModule.finalize_backward`).

Tree-wide state is the root's :class:`~fsdp.unit.root.RootContext`. Activation checkpointing:
step 3 also registers the unsharded parameters for a recomputation outside the hooks; hooks run
inside backward are a recomputation, which gathers if needed and leaves the weights to backward.
"""

from __future__ import annotations

import functools
import logging
import weakref
from types import MethodType
from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from fsdp.group.meta_init import adopt_assigned
from fsdp.group.param_group import ParameterGroup
from fsdp.group.policy import MixedPrecisionPolicy
from fsdp.group.profiling import label
from fsdp.group.shared_gather import gather_together
from fsdp.group.unsharder import Unsharder
from fsdp.unit import pipelining
from fsdp.unit.casting import cast_floats, cast_inputs
from fsdp.unit.lazy_init import find_tree
from fsdp.unit.root import MAX_REDUCTIONS_IN_FLIGHT, Finalization, RootContext, end_of_backward, finish_grad_sync
from fsdp.unit.root import reset_iter_state as reset_tree
from fsdp.unit.training_state import ALLOWED, TrainingState, check_transition, in_backward

__all__ = ["LABELS", "FSDPState", "MAX_REDUCTIONS_IN_FLIGHT", "finish_grad_sync"]

logger = logging.getLogger("fsdp")

#: Profiler labels of a unit's phases; a unit below the root appends its name: ``... (blocks.0)``.
LABELS = (
    "fsdp::lazy_init",
    "fsdp::pre_forward",
    "fsdp::root_pre_forward",  # inside the root's: post-optimizer event, dropped main grads
    "fsdp::post_forward",
    "fsdp::pre_backward",
    "fsdp::wait_reductions",  # a group's first gradient: finish the reductions still in flight
    "fsdp::post_backward",
    "fsdp::root_post_backward",
    "fsdp::finish_grad_sync",
    "fsdp::finalize_backward",
    "fsdp::reset_iter_state",
)


def _run_eagerly(hook: MethodType) -> MethodType:
    """``hook`` marked so that torch.compile calls it rather than tracing it (as FSDP2 marks its
    hooks): traced, its gathers and registrations would break the graph around ``forward``. Still a
    bound method of the state, so ``copy.deepcopy`` copies the state its hooks call."""
    return MethodType(_disabled(hook.__func__), hook.__self__)


@functools.lru_cache(maxsize=None)
def _disabled(fn: Callable) -> Callable:
    return torch.compiler.disable(fn, recursive=True, reason="fsdp's hooks communicate and register parameters")


class FSDPState(pipelining.FSDP2Names):
    def __init__(self, modules: list[nn.Module], groups: list[ParameterGroup], policy: MixedPrecisionPolicy,
                 reshard_after_forward: Optional[bool]) -> None:
        self.modules = modules
        self.groups = groups
        self.unsharders = [g.unsharder for g in groups]
        self.policy = policy
        self.reshard_after_forward = reshard_after_forward  # None: all but the root
        self.reshard_after_backward = True
        self.requires_grad_sync = True
        self.unshard_in_backward = True  # False: backward never reads the weights (FSDP2's setter)
        self.forward_prefetch: Optional[list[FSDPState]] = None  # None: the next unit run
        self.backward_prefetch: Optional[list[FSDPState]] = None  # None: the previous unit run
        self.root: Optional[FSDPState] = None  # set by the root's lazy initialisation
        self.root_ctx: Optional[RootContext] = None  # roots only (see fsdp.unit.root)
        self.fqn: Optional[str] = None  # its name below the root ("" for the root), from lazy init
        self.training_state = TrainingState.IDLE
        self.registered_unsharded = False
        self.shared_with_other_units: list[str] = []  # tied parameters another unit owns: lazy init raises
        self.read_after_forward: list[str] = []  # who reads its weights after its forward (fsdp.unit.read_watch)
        self.shared_gathers: dict = {}  # the unit's groups gathered together (fsdp.group.shared_gather)

    def install_hooks(self) -> None:
        """Called once the unit is fully built, so a failed setup leaves no hook behind."""
        for group in self.groups:
            if group.grads is not None:
                group.weights.install_grad_hooks(functools.partial(self._grad_hook, weakref.ref(group)))
        self._pre_backward_hook = _run_eagerly(self._pre_backward)
        for unsharder in self.unsharders:  # such a module recomputed in backward reads its freed weight
            for module in unsharder.forward_only_modules():
                module.register_forward_pre_hook(_run_eagerly(self._forward_only_pre_forward))
        for module in self.modules:
            module.register_forward_pre_hook(_run_eagerly(self._pre_forward), prepend=True, with_kwargs=True)
            module.register_forward_hook(_run_eagerly(self._post_forward))
        # As in FSDP2, state dicts see the sharded parameters even if forward left unsharded ones.
        holders = {id(m): m for m in self.modules}
        for group in self.groups:
            for info in group.infos:
                holders.update((id(m), m) for m, _ in info.registrations)
        for module in holders.values():
            module.register_state_dict_pre_hook(self._reshard_hook)
            module.register_load_state_dict_pre_hook(self._reshard_hook)
            module.register_load_state_dict_post_hook(self._adopt_hook)

    def _reshard_hook(self, module: nn.Module, *args) -> None:
        if self.registered_unsharded:
            self.reshard()

    def _adopt_hook(self, module: nn.Module, incompatible_keys) -> None:
        """``load_state_dict(sharded_sd, assign=True)`` put the caller's DTensors on the modules:
        adopt them as sharded parameters (:func:`fsdp.group.meta_init.adopt_assigned`)."""
        for group in self.groups:
            adopt_assigned(group)

    # ------------------------------------------------------------------ identity, state, root

    @property
    def units(self) -> list["FSDPState"]:
        """Every unit of the tree, for its root (FSDP2's ``all_states``); [] for the others."""
        return self.root_ctx.units if self.root is self and self.root_ctx is not None else []

    def name(self) -> str:
        cls = type(self.modules[0]).__name__ if self.modules else "no module"
        return cls if self.fqn is None else f"{self.fqn or '<root>'!r} ({cls})"

    def _enter(self, target: TrainingState) -> None:
        if target not in ALLOWED[self.training_state]:  # the name only for the error: off the hot path
            check_transition(self.name(), self.training_state, target)
        self.training_state = target

    def _owner(self) -> "FSDPState":
        """The unit whose context this one's backward reports to: its root, or itself before lazy
        init (gradients of parameters used after ``unshard()`` outside any forward)."""
        owner = self.root if self.root is not None else self
        if owner.root_ctx is None:
            owner.root_ctx = RootContext([owner])
        return owner

    def root_knobs(self) -> RootContext:
        """Where a knob only the root reads goes: the root's context once initialised (shared by the
        tree, as in FSDP2); before, this unit's own, kept only if the unit becomes a root (but the
        largest reduction bound any unit asked for: :func:`~fsdp.unit.lazy_init.find_tree`)."""
        return self._owner().root_ctx

    def _tree(self) -> list["FSDPState"]:
        return self.root_ctx.units if self.root_ctx is not None else [self]

    # ------------------------------------------------------------------ setup

    def _lazy_init(self) -> None:
        """The first unit to run forward becomes the root of every unit below. As in FSDP2 (same
        errors), the root must be one module, no unit below may have run forward first, no parameter
        may be tied across units; parameters assigned since ``fully_shard`` are adopted, ones on
        meta raise."""
        if self.root is not None:
            return
        if len(self.modules) > 1:
            raise RuntimeError(
                f"FSDP requires a single root module but got {self.modules}: the first module run "
                f"forward is the root; call fully_shard on a module that holds these ones and run that"
            )
        with label("fsdp::lazy_init"):
            find_tree(self)

    # ------------------------------------------------------------------ unshard / reshard

    def unshard(self, async_op: bool = False) -> None:
        self._unshard_groups(self.groups, self.unsharders, async_op)

    def unshard_for_backward(self, async_op: bool = False) -> None:
        """:meth:`unshard`, but what only forward reads stays freed (:mod:`fsdp.group.forward_only`)."""
        if not any(u.forward_only_freed() for u in self.unsharders):
            return self._unshard_groups(self.groups, self.unsharders, async_op)
        kept = [(g, u) for g, u in zip(self.groups, self.unsharders) if not u.forward_only_freed()]
        self._unshard_groups([g for g, _ in kept], [u for _, u in kept], async_op)

    def _unshard_groups(self, groups: Sequence[ParameterGroup], unsharders: Sequence[Unsharder], async_op: bool) -> None:
        for unsharder in unsharders:  # a parameter reassigned since fully_shard raises before any gather
            if not unsharder.gather_in_flight():  # a prefetch checked and refreshed it at its launch
                unsharder.check_registered()
                unsharder.prepare_gather()
        if len(unsharders) > 1:  # one collective where groups can share it
            gather_together(groups, self.shared_gathers)
        for unsharder in unsharders:
            unsharder.launch_gather(async_op=True)
        if not async_op:
            self.wait_unshard()

    def wait_unshard(self) -> None:
        for unsharder in self.unsharders:
            unsharder.wait_unshard()

    def reshard(self) -> None:
        """Free the unsharded weights (ZeRO-3) and register the sharded parameters again."""
        for unsharder in self.unsharders:
            unsharder.reshard()
        self.register_sharded_params()

    def release_after_forward(self) -> None:
        """As :meth:`reshard`, but ``reshard_after_forward=n`` groups keep their ``1/n`` slice."""
        for unsharder in self.unsharders:
            unsharder.reshard_after_forward()
        self.register_sharded_params()

    def settle_after_backward(self) -> None:
        """The end of this unit's backward: :meth:`reshard`, or without ``reshard_after_backward``
        keep the gathered weights and register the sharded parameters."""
        if self.reshard_after_backward:
            self.reshard()
        else:
            # Land a prefetch whose unit got no gradient: in flight, the next forward would take it
            # as current after an optimizer step (FSDP2's finalize_backward waits too).
            self.wait_unshard()
            self.register_sharded_params()

    def register_sharded_params(self) -> None:
        for unsharder in self.unsharders:
            unsharder.register_sharded_params()
        self.registered_unsharded = False

    def register_unsharded_params(self) -> None:
        for unsharder in self.unsharders:  # again where a freed forward-only tail was gathered back
            if not self.registered_unsharded or not unsharder.registered_unsharded():
                unsharder.register_unsharded_params()
        self.registered_unsharded = True

    # ------------------------------------------------------------------ forward

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict):
        if in_backward():  # activation checkpointing recomputes this unit's forward
            self._prepare_backward(recompute=True)
            return self._cast_inputs(args, kwargs)
        if self.root is None:
            self._lazy_init()
        with label("fsdp::pre_forward", self.fqn):
            ctx = self.root.root_ctx
            if ctx.finalization is Finalization.REDUCING:
                raise RuntimeError("The previous gradient reduction must be waited on before forward")
            self._enter(TrainingState.FORWARD)
            if self.root is self:
                self._root_pre_forward(ctx)
            ctx.ran_forward(self)
            if self.root is not self:
                self.release_dropped_grads()
            for unsharder in self.unsharders:  # another forward before backward: freeing costs a gather each
                if unsharder.forward_only_freed():
                    unsharder.keep_forward_only()
            self.unshard()
            self.register_unsharded_params()
            for nxt in self._next_units(self.forward_prefetch, +1):
                nxt.unshard(async_op=True)
            return self._cast_inputs(args, kwargs)

    def _root_pre_forward(self, ctx: RootContext) -> None:
        """Once per forward, before any gather: wait for the post-optimizer event, fix the forward
        order, free the main grads the optimizer dropped (all units, before the step allocates)."""
        with label("fsdp::root_pre_forward"):
            ctx.wait_post_optim_event()
            if ctx.root_forward_begins(torch.is_grad_enabled()) and logger.isEnabledFor(logging.DEBUG):
                logger.debug("forward order of %s (prefetching follows it): %s", self.name(),
                             [unit.fqn or "<root>" for unit in ctx.forward_order])
            for unit in ctx.units:
                unit.release_dropped_grads()

    def release_dropped_grads(self) -> None:
        """Free the main grads of this unit's groups whose gradients the optimizer dropped."""
        for group in self.groups:
            if group.grads is not None:
                group.grads.release_dropped_grads()

    def _cast_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.policy.param_dtype is not None and self.policy.cast_forward_inputs:
            args, kwargs = cast_inputs(args, kwargs, self.policy.param_dtype)
        return args, kwargs

    def reshards_after_forward(self) -> bool:
        """``reshard_after_forward``, or if None (the default, as in FSDP2): all but the root."""
        if self.read_after_forward:  # kept for a unit reading its weights later (fsdp.unit.read_watch)
            return False
        return self.root is not self if self.reshard_after_forward is None else self.reshard_after_forward

    def _post_forward(self, module: nn.Module, args: tuple, output: object) -> object:
        if in_backward():  # a recomputation: its backward runs next, on these weights
            return self._cast_output(output)
        with label("fsdp::post_forward", self.fqn):
            self._enter(TrainingState.IDLE)
            if self.root is not None:
                self.root.root_ctx.finished_forward(self)
            grad = torch.is_grad_enabled()
            resharded = self.reshards_after_forward()
            if resharded:
                self.release_after_forward()
            # The model shard is not read before the next step or backward's gather (which recasts).
            root_default = not resharded and self.root is self and self.reshard_after_forward is None
            if not resharded or grad:
                for unsharder in self.unsharders:
                    unsharder.release_model_shard()
                    if grad and root_default and self.reshard_after_backward:
                        unsharder.release_forward_only()  # False (or a later reader) keeps all, as asked
            if grad:
                for t in (output,) if isinstance(output, torch.Tensor) else tree_flatten(output)[0]:
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        t.register_hook(self._pre_backward_hook)
            return self._cast_output(output)

    def _forward_only_pre_forward(self, module: nn.Module, args: tuple) -> None:
        """A module whose weight was freed after forward is recomputed in backward: gather again."""
        if in_backward() and any(u.forward_only_freed() for u in self.unsharders):
            self.unshard()
            self.register_unsharded_params()

    def _cast_output(self, output: object) -> object:
        return output if self.policy.output_dtype is None else cast_floats(output, self.policy.output_dtype)

    def _next_units(self, explicit: Optional[list["FSDPState"]], step: int) -> list["FSDPState"]:
        if explicit is not None:
            return explicit
        return [] if self.root is None else self.root.root_ctx.neighbour(self, step)

    # ------------------------------------------------------------------ backward

    def _pre_backward(self, grad: torch.Tensor) -> None:
        self._owner()._queue_final_callback()
        self._prepare_backward(recompute=False)

    def _prepare_backward(self, recompute: bool) -> None:
        """Gather and register the unsharded parameters for this unit's backward (which a
        recomputation must read) and prefetch the unit before it, once per backward; a
        recomputation (``recompute``) gathers again if the weights were freed since."""
        prepared = self.training_state is TrainingState.PRE_BACKWARD
        if prepared and not recompute:
            return
        with label("fsdp::pre_backward", self.fqn):
            self._enter(TrainingState.PRE_BACKWARD)
            if self.unshard_in_backward or recompute:
                self.unshard() if recompute else self.unshard_for_backward()
                self.register_unsharded_params()
            if prepared:
                return
            for prev in self._next_units(self.backward_prefetch, -1):
                prev.unshard_for_backward(async_op=True)

    def _grad_hook(self, group_ref: weakref.ref, k: int) -> Callable[[torch.Tensor], None]:
        """Parameter ``k``'s post-accumulate-grad hook. Unseen by the GC in autograd's C++ table, it
        holds unit and group weakly (else a cycle is never freed); a no-op once they are gone."""
        unit_ref = weakref.ref(self)

        def hook(p: torch.Tensor) -> None:
            unit, group = unit_ref(), group_ref()
            if unit is not None and group is not None:
                unit._on_grad(group, k, p)

        return hook

    def _on_grad(self, group: ParameterGroup, k: int, p: torch.Tensor) -> None:
        """Parameter ``k``'s gradient is ready: the group's reducer takes it; the group's first of
        a round finishes the reductions in flight, its last launches the group's reduction."""
        grad, p.grad = p.grad, None
        if grad is None:
            return
        grads = group.grads
        if grads.starts_round():
            self._finish_reductions_in_flight()
        if grads.take(k, grad):
            self._on_group_grads_done(group)

    def _finish_reductions_in_flight(self) -> None:
        """Before a group's first gradient or buffer (:class:`~fsdp.group.grads.GradReducer`),
        finish the reductions in flight (they had a unit's backward to run), so their buffers do
        not coexist with the new ones; a second call in a round finds only those launched since."""
        ctx = self._owner().root_ctx
        if ctx.reductions_in_flight:
            with label("fsdp::wait_reductions", self.fqn):
                ctx.finish_reductions()

    def _on_group_grads_done(self, group: ParameterGroup) -> None:
        with label("fsdp::post_backward", self.fqn):
            if self.reshard_after_backward:
                # A later pre-backward in this backward (forward ran twice) must gather again.
                self._enter(TrainingState.POST_BACKWARD)
            owner = self._owner()
            owner._queue_final_callback()
            if self.reshard_after_backward:  # first, as FSDP2: the weights go before grad_in comes
                group.unsharder.reshard()
            group.grads.pack_held(self._finish_reductions_in_flight)
            if self.requires_grad_sync:
                group.grads.launch_reduce()
                owner.root_ctx.launched(group.grads)

    def _queue_final_callback(self) -> None:
        ctx = self.root_ctx
        if not ctx.final_callback_queued:
            ctx.final_callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(_run_eagerly(self._final_callback))

    def _final_callback(self) -> None:
        """The root's end of backward (:func:`fsdp.unit.root.end_of_backward`)."""
        end_of_backward(self.root_ctx)

    def finish_grad_sync(self, launch: bool = True) -> None:
        """Wait for every reduction of this tree and attach the gradients; with ``launch``, first
        reduce gradients still held locally (``set_requires_gradient_sync(False)``)."""
        finish_grad_sync(self._tree(), launch)

    def reset_iter_state(self) -> None:
        """Recover after a forward or backward raised (:func:`fsdp.unit.root.reset_iter_state`)."""
        reset_tree(self)
