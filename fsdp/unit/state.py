"""FSDPState: one unit's hooks around forward and backward, prefetching, and the end of backward.

Life of a step, per unit (ZeRO-3 shown; the other strategies skip the gathers and frees):

1. forward pre-hook: refresh model weights if the optimizer stepped, all-gather (or wait for a
   prefetched gather), register the unsharded parameters, start gathering the next unit;
2. forward post-hook: with ``reshard_after_forward`` (default: every unit but the root, whose
   backward comes next), register the sharded parameters again and free the unsharded storage;
   otherwise the unsharded parameters stay registered (as in FSDP2, under ``no_grad`` too) until
   step 5 or ``reshard()``. Hook the outputs so that their gradient triggers step 3;
3. pre-backward (first output gradient): gather again, start gathering the unit before it;
4. each parameter's post-accumulate-grad hook takes its gradient from autograd; the group's
   first one finishes the reduction still in flight; when a group has all of them they are
   copied into its ``grad_in`` (allocated only then, as FSDP2 allocates its reduce-scatter
   input), its reduction starts (async; at most one in flight) and its unsharded storage is freed;
5. the root's final callback (queued on the autograd engine) reduces whatever is left, reshards
   every unit, waits for every reduction and attaches ``param.grad``.

Activation checkpointing: step 3 also registers the unsharded parameters, for a recomputation
that runs outside the unit's hooks (``checkpoint_wrapper`` applied before ``fully_shard``,
transformers 5); a forward whose hooks run inside backward (``checkpoint(layer.__call__)``,
transformers 4) is a recomputation: it gathers if needed and registers, and its post-hook leaves
the weights for the backward that follows. Every hook is registered through :func:`_run_eagerly`
so that ``torch.compile`` of a unit's module calls it instead of tracing it.
"""

from __future__ import annotations

import functools
from types import MethodType
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map

from dbuffer.collectives import release_workspaces
from fsdp.group.meta_init import meta_error
from fsdp.group.param_group import ParameterGroup
from fsdp.group.policy import MixedPrecisionPolicy

__all__ = ["FSDPState", "finish_grad_sync"]

# One reduction in flight while the next unit computes its gradients: a unit's backward takes far
# longer than reducing its shard, so a second one in flight buys no overlap and costs a whole
# unsharded gradient buffer at the step's memory peak (measured: 13 MiB of 419 on the benchmark).
MAX_REDUCTIONS_IN_FLIGHT = 1


def _run_eagerly(hook: MethodType) -> MethodType:
    """``hook`` (a bound method) marked so that torch.compile calls it as it is instead of
    tracing it.

    ``module.compile()`` compiles ``nn.Module._call_impl``, which runs the forward hooks: traced,
    every gather, wait, storage resize and parameter registration in them would break the graph
    (FSDP2 marks its hooks the same way). The marked function is registered as the hook itself,
    so dynamo finds no frame of ours to trace around it: it skips ``_call_impl``'s frames, calls
    the hooks eagerly and compiles the module's ``forward`` into one graph between them. It stays
    a method of the state (one marked function per method), so ``copy.deepcopy`` of a sharded
    module copies the state its hooks call, as it did for plain bound methods."""
    return MethodType(_disabled(hook.__func__), hook.__self__)


@functools.lru_cache(maxsize=None)
def _disabled(fn: Callable) -> Callable:
    return torch.compiler.disable(fn, recursive=True, reason="fsdp's hooks communicate and register parameters")


class FSDPState:
    def __init__(
        self,
        modules: list[nn.Module],
        groups: list[ParameterGroup],
        policy: MixedPrecisionPolicy,
        reshard_after_forward: Optional[bool],
    ) -> None:
        self.modules = modules
        self.groups = groups
        self.policy = policy
        self.reshard_after_forward = reshard_after_forward  # None: all but the root
        self.reshard_after_backward = True
        self.requires_grad_sync = True
        self.is_last_backward = True
        self.unshard_in_backward = True  # False: backward never reads the weights (FSDP2's setter)
        self.max_reductions_in_flight = MAX_REDUCTIONS_IN_FLIGHT  # root only
        self.post_optim_event: Optional[Any] = None  # root only: waited for before the next gathers
        self.forward_prefetch: Optional[list[FSDPState]] = None  # None: the next unit run
        self.backward_prefetch: Optional[list[FSDPState]] = None  # None: the previous unit run
        self.root: Optional[FSDPState] = None
        self.units: list[FSDPState] = []  # root only: every unit of its tree
        self.forward_order: list[FSDPState] = []  # root only: units in the order they ran
        self._order_recorded = False
        self._unsharded = False  # the unsharded parameters are registered
        self._pre_backward_done = False
        self._callback_queued = False
        self._in_flight: list[ParameterGroup] = []  # root only: reductions launched, oldest first
        self._filling: list[ParameterGroup] = []  # root only: groups with some gradients, not all
        self.shared_with_other_units: list[str] = []  # tied parameters another unit owns: lazy init raises

    def install_hooks(self) -> None:
        """Called once the unit is fully built, so a failed setup leaves no hook behind."""
        for group in self.groups:
            if group.grads is not None:
                group.grads.register_hooks(self._on_group_grads_done, self._on_group_grads_start)
        self._pre_backward_hook = _run_eagerly(self._pre_backward)
        for module in self.modules:
            module.register_forward_pre_hook(_run_eagerly(self._pre_forward), prepend=True, with_kwargs=True)
            module.register_forward_hook(_run_eagerly(self._post_forward))
        # Like FSDP2: state dicts see (and load into) the sharded parameters even when a forward
        # left the unsharded ones registered.
        holders = {id(m): m for m in self.modules}
        for group in self.groups:
            for info in group.infos:
                holders.update((id(m), m) for m, _ in info.registrations)
        for module in holders.values():
            module.register_state_dict_pre_hook(self._reshard_hook)
            module.register_load_state_dict_pre_hook(self._reshard_hook)
            module.register_load_state_dict_post_hook(self._adopt_hook)

    def _reshard_hook(self, module: nn.Module, *args) -> None:
        if self._unsharded:
            self.reshard()

    def _adopt_hook(self, module: nn.Module, incompatible_keys) -> None:
        """``load_state_dict(sharded_sd, assign=True)`` put the caller's DTensors on the modules:
        they become this unit's sharded parameters now (see ``ParameterGroup.adopt_assigned``),
        so the model right after the load already holds fsdp's layout."""
        for group in self.groups:
            group.adopt_assigned()

    # ------------------------------------------------------------------ setup

    def _lazy_init(self) -> None:
        """The first unit to run forward is the root of every unit below it. As in FSDP2 (same
        errors): the root must be one module; no unit below it may have run forward first (it
        would have become a root of its own, with its own end-of-backward); no parameter may be
        tied across two units (each would train its own copy); parameters assigned
        since ``fully_shard`` (``load_state_dict(..., assign=True)`` of sharded DTensors) are
        adopted now, and parameters still on the meta device raise."""
        if self.root is not None:
            return
        if len(self.modules) > 1:
            raise RuntimeError(
                f"FSDP requires a single root module but got {self.modules}: the first module run "
                f"forward is the root; call fully_shard on a module that holds these ones and run that"
            )
        units: list[FSDPState] = []
        for name, m in self.modules[0].named_modules():
            state = getattr(m, "_fsdp_state", None)  # set by fully_shard on every unit's module
            if not isinstance(state, FSDPState) or state in units:
                continue
            if state is not self and state.root is not None:
                raise RuntimeError(
                    f"FSDP state has already been lazily initialized for {name}\nFSDP requires running "
                    f"forward through the root module first"
                )
            units.append(state)
        shared = [message for state in units for message in state.shared_with_other_units]
        if shared:  # local and identical on every rank (same model): raised before any collective
            raise ValueError(shared[0])
        for state in units:
            for group in state.groups:
                group.adopt_assigned()
        names = {id(p): n for top in self.modules for n, p in top.named_parameters(remove_duplicate=False)}
        for state in units:
            on_meta = [p for g in state.groups if g.is_meta for p in g.sharded_params]
            if on_meta:
                raise RuntimeError(meta_error([names.get(id(p), "?") for p in on_meta]))
        self.root = self
        for state in units:
            state.root = self
        self.units = units

    # ------------------------------------------------------------------ unshard / reshard

    def unshard(self, async_op: bool = False) -> None:
        for group in self.groups:  # a parameter reassigned since fully_shard raises before any gather
            group.check_registered()
        for group in self.groups:
            group.unshard(async_op=True)
        if not async_op:
            self.wait_unshard()

    def wait_unshard(self) -> None:
        for group in self.groups:
            group.wait_unshard()

    def reshard(self, free: bool = True, after_forward: bool = False) -> None:
        """Register the sharded parameters again; with ``free``, also release the unsharded
        storage (ZeRO-3). Without it the next unshard skips the gather unless the optimizer
        has stepped since. ``after_forward``: groups with ``reshard_after_forward=n`` keep
        their ``1/n`` slice for backward."""
        for group in self.groups:
            if free and after_forward:
                group.reshard_after_forward()
            elif free:
                group.reshard()
            group.use_params(unsharded=False)
        self._unsharded = False

    def _use_unsharded(self) -> None:
        if not self._unsharded:
            for group in self.groups:
                group.use_params(unsharded=True)
            self._unsharded = True

    # ------------------------------------------------------------------ forward

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict):
        if _in_backward():  # activation checkpointing recomputes this unit's forward
            self._prepare_backward(recompute=True)
            return self._cast_inputs(args, kwargs)
        if self.root is None:
            self._lazy_init()
        root = self.root
        if root is self and self.post_optim_event is not None:
            self.streams_wait_event(self.post_optim_event)
            self.post_optim_event = None
        if root is self and torch.is_grad_enabled():
            self._order_recorded = bool(self.forward_order)
        if not root._order_recorded and self not in root.forward_order:
            root.forward_order.append(self)
        # The root frees every unit's main grads the optimizer dropped (zero_grad, set_to_none)
        # before anything of the step is allocated, not each unit at its own forward.
        for unit in root.units if root is self else [self]:
            for group in unit.groups:
                if group.grads is not None:
                    group.grads.release_dropped_grads()
        self.unshard()
        self._use_unsharded()
        for nxt in self._next_units(self.forward_prefetch, +1):
            nxt.unshard(async_op=True)
        return self._cast_inputs(args, kwargs)

    def _cast_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.policy.param_dtype is not None and self.policy.cast_forward_inputs:
            args, kwargs = _cast_floats((args, kwargs), self.policy.param_dtype)
        return args, kwargs

    def reshards_after_forward(self) -> bool:
        """``reshard_after_forward``, or if None (the default, as in FSDP2): all but the root."""
        if self.reshard_after_forward is None:
            return self.root is not self
        return self.reshard_after_forward

    def _post_forward(self, module: nn.Module, args: tuple, output: Any):
        if _in_backward():  # a recomputation: its backward runs next, on these weights
            return self._cast_output(output)
        grad = torch.is_grad_enabled()
        resharded = self.reshards_after_forward()
        if resharded:
            self.reshard(after_forward=True)
        # Gathered until backward ends, the model shard is not read before the next step. Resharded
        # with a backward to come, it is not read before that backward's gather, which casts it again
        # (once per step instead of keeping it through the activations' peak, the start of backward).
        if not resharded or grad:
            for group in self.groups:
                group.release_model_shard()
        # Otherwise the unsharded parameters stay registered and gathered (with or without grad,
        # as in FSDP2) until the end of backward or reshard().
        if grad:
            self._pre_backward_done = False
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._pre_backward_hook)
        return self._cast_output(output)

    def _cast_output(self, output: Any) -> Any:
        if self.policy.output_dtype is not None:
            output = _cast_floats(output, self.policy.output_dtype)
        return output

    def _next_units(self, explicit: Optional[list["FSDPState"]], step: int) -> list["FSDPState"]:
        if explicit is not None:
            return explicit
        order = self.root.forward_order if self.root is not None else []
        if not self.root._order_recorded or self not in order:
            return []
        k = order.index(self) + step
        return [order[k]] if 0 <= k < len(order) else []

    # ------------------------------------------------------------------ backward

    def _pre_backward(self, grad: torch.Tensor) -> None:
        self.root._queue_final_callback()
        self._prepare_backward(recompute=False)

    def _prepare_backward(self, recompute: bool) -> None:
        """Gather and register the unsharded parameters for this unit's backward, and start
        gathering the unit before it (once per backward).

        Registering matters for activation checkpointing: a recomputation reads the module's
        parameters, which must be the unsharded ones its backward differentiates (not the
        sharded DTensors). A recomputation (``recompute``: this unit's forward hooks run inside
        backward) always gathers again if the weights were freed since, e.g. a unit resharding
        after forward, or recomputed twice."""
        if self._pre_backward_done and not recompute:
            return
        if self.unshard_in_backward or recompute:  # set_unshard_in_backward(False): not needed
            self.unshard()
            self._use_unsharded()
        if self._pre_backward_done:
            return
        self._pre_backward_done = True
        for prev in self._next_units(self.backward_prefetch, -1):
            prev.unshard(async_op=True)

    def _on_group_grads_start(self, group: ParameterGroup) -> None:
        """A group got its first gradient of this backward, or is about to allocate its gradient
        buffer: finish the reductions still in flight first (by now they have had a whole unit's backward to run), so that their
        buffers are freed before this one exists."""
        root = self.root if self.root is not None else self
        while root._in_flight:
            root._in_flight.pop(0).grads.finish_reduce()

    def _on_group_grads_done(self, group: ParameterGroup) -> None:
        root = self.root if self.root is not None else self
        root._queue_final_callback()
        if self.requires_grad_sync:
            group.grads.launch_reduce()
            # Bound the reductions in flight: finishing older ones frees their unsharded gradient
            # buffers during backward, instead of all of them living until its end.
            root._in_flight.append(group)
            while len(root._in_flight) > root.max_reductions_in_flight:
                root._in_flight.pop(0).grads.finish_reduce()
        if self.reshard_after_backward:
            group.reshard()
            # A later pre-backward of this unit in the same backward (it ran forward twice and
            # its gradients came in two rounds) must gather again.
            self._pre_backward_done = False

    def _queue_final_callback(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(_run_eagerly(self._final_callback))

    def _final_callback(self) -> None:
        self._callback_queued = False
        self._in_flight.clear()  # whatever is still in flight is finished below
        units = self.units or [self]
        for unit in units:
            if unit.requires_grad_sync:
                for group in unit.groups:
                    if group.grads is not None and group.grads.has_local_grads():
                        group.grads.launch_reduce()
            unit.reshard(free=unit.reshard_after_backward)
            unit._pre_backward_done = False
            for group in unit.groups:
                if group.grads is not None:
                    group.grads.end_backward()
        if self.is_last_backward:
            self.finish_grad_sync(launch=False)
        # Idle collective scratch would otherwise stay through the next forward, the peak of a
        # step; the next backward's first reduction allocates it again.
        release_workspaces()

    def finish_grad_sync(self, launch: bool = True) -> None:
        """Wait for every reduction of this tree and attach the gradients; with ``launch``, first
        reduce gradients still held locally (after ``set_requires_gradient_sync(False)``)."""
        finish_grad_sync(self.units or [self], launch)

    def streams_wait_event(self, event: Any) -> None:
        """The next gathers start after ``event`` (FSDP2's ``set_post_optim_event``): on CUDA the
        all-gather stream waits for it (it also still waits for the current stream); elsewhere
        the host waits for it."""
        streams = next((g.streams for unit in (self.units or [self]) for g in unit.groups), None)
        if streams is not None and streams.enabled:
            streams.all_gather.wait_event(event)
        else:
            event.synchronize()

    def reset_iter_state(self) -> None:
        """Recover after a forward or backward raised (FSDP2's ``reset_iter_state``): wait for
        gathers, drop every gradient not yet reduced into the main grads (the failed
        iteration's, and those of microbatches accumulated without sync), reshard every unit and
        forget the iteration's progress. Only the root may do it: it owns the end of backward."""
        if self.root is not None and self.root is not self:  # never run: nothing to reset but itself
            raise RuntimeError(
                "reset_iter_state must be called on the root FSDP module (the one whose forward ran "
                "first, normally the one fully_shard was applied to last)"
            )
        self._callback_queued = False
        self._in_flight.clear()
        for unit in self.units or [self]:
            for group in unit.groups:
                group.wait_unshard()
                if group.grads is not None:
                    group.grads.discard_in_flight()
            unit.reshard()
            unit._pre_backward_done = False
        release_workspaces()


def finish_grad_sync(units: list[FSDPState], launch: bool) -> None:
    reducers = [g.grads for unit in units for g in unit.groups if g.grads is not None]
    if launch:
        for grads in reducers:  # all launched before any wait: they overlap
            grads.launch_reduce()
    for grads in reducers:
        grads.finish_reduce()
        grads.attach_grads()


def _in_backward() -> bool:
    """Whether this thread is running autograd's backward: a forward there is activation
    checkpointing's recomputation (``torch.utils.checkpoint``, reentrant or not, HF's
    ``gradient_checkpointing``), not a new step."""
    return torch._C._current_graph_task_id() != -1


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return tree_map(cast, tree)
