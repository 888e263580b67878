"""FSDPModule: the methods a sharded module gains, shaped like torch FSDP2's.

``fully_shard`` swaps a module's class to ``FSDP<Orig>(FSDPModule, Orig)``; more setters are in
:mod:`fsdp.unit.surface`. Each method acts through the unit's :class:`~fsdp.unit.state.FSDPState`.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
import torch.nn as nn

from fsdp.group.convert import accepts_device, check_convert, convert
from fsdp.group.meta_init import materialize
from fsdp.group.param_group import ParameterGroup
from fsdp.unit import surface
from fsdp.unit.root import finalize_backward, finish_finalized
from fsdp.unit.root import Finalization
from fsdp.unit.state import FSDPState, finish_grad_sync
from fsdp.unit.surface import ArgumentTypeError
from fsdp.unit.training_state import in_backward

__all__ = ["FSDPModule", "GradientReductionHandle", "UnshardHandle", "register_fsdp_forward_method", "state_of_module"]

_CLASS_CACHE: dict[type, type] = {}


class UnshardHandle:
    """Returned by ``unshard(async_op=True)``, as FSDP2's; built from the unit's ``state``
    (:class:`~fsdp.unit.state.FSDPState`; None: nothing to wait for), never by users. ``wait()``
    finishes the all-gathers and registers the unsharded parameters; idempotent, it raises
    whatever the collective raised (e.g. dbuffer's ``CollectiveMismatchError`` in debug mode)."""

    def __init__(self, state: Optional[FSDPState]) -> None:
        self._state = state

    def wait(self) -> None:
        """Finish the all-gathers, register the unsharded parameters; then a no-op."""
        if self._state is not None:
            self._state.wait_unshard()
            self._state.register_unsharded_params()
            self._state = None


class GradientReductionHandle:
    """Returned by ``finalize_backward(async_op=True)``, as torch 2.15's; built from the root's
    ``state`` (None: nothing to wait for). ``wait()`` waits for the reductions and attaches
    ``.grad``, ending the iteration (until then gradients must not be read, a forward raises).
    Idempotent; raises ``RuntimeError`` if ``reset_iter_state`` dropped the iteration, or what a
    collective raised."""

    def __init__(self, state: Optional[FSDPState]) -> None:
        self._state = state

    def wait(self) -> None:
        """Wait for gradient reduction and release its retained buffers; then a no-op."""
        state, self._state = self._state, None
        if state is not None:
            finish_finalized(state)


class FSDPModule:
    """Mixin of every sharded module: ``fully_shard`` swaps a module's class to
    ``FSDP<Orig>(FSDPModule, Orig)``, so ``isinstance(m, fsdp.FSDPModule)`` tells a unit's top
    module. Methods act on this unit (``recurse=False``) or every unit below (``recurse=True``);
    none runs a collective unless it says so. Misuse raises FSDP2's exception types (``ValueError``
    for ``set_reshard_after_forward(2)``, ``TypeError`` for a prefetch of a module not sharded)."""

    _fsdp_state: FSDPState

    def unshard(self, async_op: bool = False) -> Optional[UnshardHandle]:
        """All-gather this unit's parameters now (e.g. to overlap with other work)."""
        state = self._fsdp_state
        state.unshard(async_op=async_op)
        if async_op:
            return UnshardHandle(state)
        state.register_unsharded_params()
        return None

    def reshard(self) -> None:
        """Register the sharded parameters again and free the unsharded ones (ZeRO-3)."""
        self._fsdp_state.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: accumulate gradients locally (no communication) until a backward with sync on,
        or :meth:`finish_grad_sync`."""
        for state in self._states(recurse):
            state.requires_grad_sync = requires_gradient_sync

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """False: keep the weights gathered after backward (until the next reshard)."""
        for state in self._states(recurse):
            state.reshard_after_backward = reshard_after_backward

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Explicit from now on (the root's default no longer applies): a bool, else ValueError."""
        if not isinstance(reshard_after_forward, bool):
            raise ArgumentTypeError(
                f"reshard_after_forward should be a bool, got {type(reshard_after_forward)}; pass True or False"
            )
        for state in self._states(recurse):
            state.reshard_after_forward = reshard_after_forward

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """False: backward's end leaves reductions in flight and ``.grad`` unattached until a last
        backward or :meth:`finish_grad_sync`; the root's knob, set from any initialised unit."""
        self._fsdp_state.root_knobs().is_last_backward = is_last_backward

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """True: each backward's end leaves reductions, reshards and ``.grad`` to
        :meth:`finalize_backward`, once per step (torch 2.15's, for pipeline schedules). Set it on
        the root before backward: ``RuntimeError`` below the root (at the first forward if not yet
        initialised), during backward or while a backward waits for its finalization."""
        state = self._fsdp_state
        if state.root is not None and state.root is not state:
            raise RuntimeError("set_manual_backward_finalization must be called on the root FSDP module")
        ctx = state.root_knobs()
        if enabled != ctx.manual_finalization:
            if in_backward():
                raise RuntimeError("set_manual_backward_finalization cannot change mode during backward")
            if ctx.finalization is not Finalization.OPEN:
                raise RuntimeError("set_manual_backward_finalization cannot change mode after backward starts")
        ctx.manual_finalization = bool(enabled)

    def finalize_backward(self, *, async_op: bool = False) -> Optional[GradientReductionHandle]:
        """End the backward iteration under manual finalization: reduce, reshard, wait and attach
        ``.grad`` (``async_op``: the returned :class:`GradientReductionHandle` waits and attaches);
        a no-op before the first forward. Raises ``RuntimeError`` without manual finalization, off
        the root, inside backward, or while a previous handle is not waited for."""
        state = self._fsdp_state
        if state.root is None:
            return GradientReductionHandle(None) if async_op else None
        finalize_backward(state)
        handle = GradientReductionHandle(state)
        if async_op:
            return handle
        handle.wait()
        return None

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """True: a reshard keeps the unsharded storage, so data pointers survive reshard/unshard
        (CUDA graph capture), at the cost of that memory; the next gather refills it in place."""
        for state in self._states(recurse):
            for group in state.groups:
                group.weights.keep_unsharded_storage = bool(keep)
                group.replan()

    def set_modules_to_forward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """Start gathering these units right after this unit's forward gather (replacing the
        default, the next unit in forward order). ``TypeError`` for a module not sharded."""
        self._fsdp_state.forward_prefetch = [_state_of(m) for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """Start gathering these units right after this unit's backward gather (replacing the
        default, as FSDP2's: the next unit in reverse order of forward ends). ``TypeError`` for a
        module not sharded."""
        self._fsdp_state.backward_prefetch = [_state_of(m) for m in modules]

    def to_empty(self, *, device, recurse: bool = True):
        """``nn.Module.to_empty``, as in FSDP2: a unit built on meta allocates only its shards on
        ``device``, keeping the parameter objects, to initialise (:func:`init_weights`) or load;
        ``device`` must be of the mesh's type (the host too, under CPU offload), else ValueError."""
        device = torch.device(device)
        if device.type != "meta":
            for state in self._states(recurse):
                for group in state.groups:
                    materialize(group, device)
        for state in self._states(recurse):
            for group in state.groups:
                have = group.main.device
                if not accepts_device(group, device):
                    raise ValueError(
                        f"to_empty(device={device}): fully_shard allocated the shards on {have}, the mesh's "
                        f"device (or the host, under CPU offload); pass that device (or build the mesh for "
                        f"{device.type})"
                    )
        return super().to_empty(device=device, recurse=recurse)  # type: ignore[misc]  # via _apply

    def _apply(self, fn, recurse: bool = True):
        """What ``nn.Module.to``, ``float``, ``cuda``, ... run: sharded parameters of every unit
        below follow the new dtype (:func:`fsdp.group.convert.convert`), after a reshard (call it
        between steps); a device other than the mesh's raises before anything changes."""
        states = self._states(recurse)
        targets = {id(g): _conversion_target(fn, g) for state in states for g in state.groups}
        for state in states:  # every unit below is checked before any changes
            for group in state.groups:
                check_convert(group, *targets[id(group)])
        state = self._fsdp_state
        state.reshard()  # the unsharded parameters are rebuilt
        for group in state.groups:
            convert(group, *targets[id(group)])
        hidden = []  # nested units hide their own when nn.Module._apply reaches them
        for group in state.groups:
            for info in group.infos:
                for module, name in info.registrations:
                    hidden.append((module, name, module._parameters[name]))
                    module._parameters[name] = None  # nn.Module._apply skips None
        try:
            return super()._apply(fn, recurse)  # type: ignore[misc]
        finally:
            for module, name, param in reversed(hidden):
                module._parameters[name] = param

    set_requires_all_reduce = surface.set_requires_all_reduce
    set_all_reduce_hook = surface.set_all_reduce_hook
    set_gradient_divide_factor = surface.set_gradient_divide_factor
    set_reduce_scatter_divide_factor = surface.set_reduce_scatter_divide_factor
    set_force_sum_reduction_for_comms = surface.set_force_sum_reduction_for_comms
    set_unshard_in_backward = surface.set_unshard_in_backward
    set_post_optim_event = surface.set_post_optim_event
    set_custom_all_gather = surface.set_custom_all_gather
    set_custom_reduce_scatter = surface.set_custom_reduce_scatter
    set_reduce_scatter_unused_params = surface.set_reduce_scatter_unused_params
    set_reduce_scatter_max_input_buffers = surface.set_reduce_scatter_max_input_buffers
    set_separate_reduce_scatter_group = surface.set_separate_reduce_scatter_group
    set_allocate_memory_from_process_group_for_comm = surface.set_allocate_memory_from_process_group_for_comm
    set_symm_mem_for_comm = surface.set_symm_mem_for_comm
    reset_iter_state = surface.reset_iter_state

    def _get_fsdp_state(self) -> FSDPState:
        """This unit's state (what ``fully_shard.state(self)`` returns)."""
        return self._fsdp_state

    def zero_grad_buffer(self) -> None:
        """Zero the main-grad buffers of every unit below (``param.grad`` views stay attached)."""
        for state in self._states(True):
            for group in state.groups:
                if group.grads is not None:
                    group.grads.zero_grad_buffer()

    def finish_grad_sync(self) -> None:
        """Reduce gradients still held locally, wait for every reduction, attach ``.grad``."""
        finish_grad_sync(self._states(True), launch=True)

    def _states(self, recurse: bool) -> list[FSDPState]:
        if not recurse:
            return [self._fsdp_state]
        states: list[FSDPState] = []
        for m in self.modules():  # type: ignore[attr-defined]
            if isinstance(m, FSDPModule) and m._fsdp_state not in states:
                states.append(m._fsdp_state)
        return states


def _conversion_target(fn: Callable[[torch.Tensor], torch.Tensor], group: ParameterGroup):
    """(dtype, device) ``fn`` turns the group's main weights into, probed on an empty tensor."""
    probe = torch.empty(0, dtype=group.dtypes.main, device=group.main.device)
    try:
        out = fn(probe)
    except Exception as e:
        e.add_note(f"(fully_shard: converting sharded parameters {group.names()}, on {group.main.device})")
        raise
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"an nn.Module._apply function returned {type(out).__name__} for a tensor")
    return out.dtype, out.device


def _state_of(module: nn.Module) -> FSDPState:
    if not isinstance(module, FSDPModule):
        raise TypeError(f"{type(module).__name__} is not sharded; pass modules returned by fully_shard")
    return module._fsdp_state


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run the unit's forward hooks (gather before, reshard after) around ``module.<method_name>``
    too, e.g. ``generate``, as FSDP2's function does. ``module``: one returned by ``fully_shard``
    (else ``TypeError``); ``method_name``: one of its methods (else ``AttributeError``), replaced
    on this module object only. No collective runs until it is called."""
    state = _state_of(module)
    method = getattr(module, method_name)

    @functools.wraps(method)
    def wrapped(*args, **kwargs):
        args, kwargs = state._pre_forward(module, args, kwargs)
        return state._post_forward(module, args, method(*args, **kwargs))

    setattr(module, method_name, wrapped)


def state_of_module(module: nn.Module) -> Optional[FSDPState]:
    """``fully_shard.state(module)``: the state of the unit ``module`` is a top module of (the same
    for each module of a ``fully_shard([a, b])``), else None."""
    return module.__dict__.get("_fsdp_state") if isinstance(module, FSDPModule) else None


def fsdp_class(cls: type) -> type:
    if cls not in _CLASS_CACHE:
        _CLASS_CACHE[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    return _CLASS_CACHE[cls]
