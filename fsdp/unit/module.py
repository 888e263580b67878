"""FSDPModule: the methods a sharded module gains, shaped like torch FSDP2's.

``fully_shard`` (:mod:`fsdp.unit.fully_shard`) swaps a module's class to ``FSDP<Orig>``, a
subclass of :class:`FSDPModule` and the original class, so FSDP2's methods (``unshard``,
``reshard``, ``set_requires_gradient_sync``, ...) are available on it; the rest of FSDP2's setters
are in :mod:`fsdp.unit.surface`. Each method acts through the unit's
:class:`~fsdp.unit.state.FSDPState`.
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
    """Returned by ``unshard(async_op=True)``, as FSDP2's: ``wait()`` finishes the unit's
    all-gathers and registers the unsharded parameters on the modules.

    ``state``: the unit's :class:`~fsdp.unit.state.FSDPState` (None: nothing to wait for), set by
    :meth:`FSDPModule.unshard`; users never build one. ``wait()`` is idempotent (a second call
    returns at once) and raises whatever the collective raised (a backend error, or dbuffer's
    ``CollectiveMismatchError`` in debug mode).
    """

    def __init__(self, state: Optional[FSDPState]) -> None:
        self._state = state

    def wait(self) -> None:
        """Finish the all-gathers started by ``unshard(async_op=True)`` and register the unsharded
        parameters; a no-op after the first call."""
        if self._state is not None:
            self._state.wait_unshard()
            self._state.register_unsharded_params()
            self._state = None


class GradientReductionHandle:
    """Returned by ``finalize_backward(async_op=True)``, as torch 2.15's: ``wait()`` waits for the
    gradient reductions the finalization launched and attaches ``.grad``: the end of the backward
    iteration. Until then the gradients must not be read and no forward of the tree may run
    (it raises).

    ``state``: the root's :class:`~fsdp.unit.state.FSDPState` (None: nothing to wait for, e.g.
    a finalization before the first forward), set by :meth:`FSDPModule.finalize_backward`; users
    never build one. ``wait()`` is idempotent; it raises ``RuntimeError`` if ``reset_iter_state``
    dropped the iteration since, and whatever a collective raised."""

    def __init__(self, state: Optional[FSDPState]) -> None:
        self._state = state

    def wait(self) -> None:
        """Wait for gradient reduction and release its retained buffers (a no-op after the
        first call)."""
        state, self._state = self._state, None
        if state is not None:
            finish_finalized(state)


class FSDPModule:
    """Mixin of every sharded module: ``fully_shard`` swaps a module's class to
    ``FSDP<Orig>(FSDPModule, Orig)``, so ``isinstance(m, fsdp.FSDPModule)`` tells a unit's top
    module, and the module gains torch FSDP2's methods (``unshard``, ``reshard``,
    ``set_requires_gradient_sync``, ``set_reshard_after_forward``, ``set_is_last_backward``, the
    prefetch setters, the rest of FSDP2's setters from :mod:`fsdp.unit.surface`) and
    Megatron-FSDP's (``zero_grad_buffer``, ``finish_grad_sync``). Never built directly.

    Methods act on this unit (``recurse=False``) or every unit below (``recurse=True``); none runs
    a collective unless it says so (``unshard``, ``finish_grad_sync``), so a setter called on some
    ranks only cannot hang, but a setting that changes what is communicated must be made on every
    rank. Misuse raises FSDP2's exception types (e.g. ``set_reshard_after_forward(2)``:
    ``ValueError``; a prefetch list holding a module that is not sharded: ``TypeError``).
    """

    _fsdp_state: FSDPState

    # ---------------------------------------------------------------- FSDP2 surface

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
        """False: keep accumulating unsharded gradients locally (no communication) until a
        backward with sync on, or :meth:`finish_grad_sync`."""
        for state in self._states(recurse):
            state.requires_grad_sync = requires_gradient_sync

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """False: keep the gathered weights after the unit's backward (FSDP2's knob, e.g. for
        several backwards per step); they are freed at the next reshard."""
        for state in self._states(recurse):
            state.reshard_after_backward = reshard_after_backward

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Explicit from now on (the root's default of not resharding no longer applies). A bool
        only, as in FSDP2 (whose error, ``ValueError``, this also is)."""
        if not isinstance(reshard_after_forward, bool):
            raise ArgumentTypeError(
                f"reshard_after_forward should be a bool, got {type(reshard_after_forward)}; pass True or False"
            )
        for state in self._states(recurse):
            state.reshard_after_forward = reshard_after_forward

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """False: the end of backward leaves reductions in flight and ``.grad`` unattached; a
        later last backward or :meth:`finish_grad_sync` completes them. Read by the root (set it
        there; on another unit of an initialised tree it reaches the root too, as in FSDP2)."""
        self._fsdp_state.root_knobs().is_last_backward = is_last_backward

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """True: the end of each backward leaves reductions, reshards and ``.grad`` to
        :meth:`finalize_backward`, called once after all the backwards of a step (torch 2.15's; a
        pipeline schedule does it; it supersedes :meth:`set_is_last_backward`). Call it on the
        root, before backward. Raises ``RuntimeError`` on a unit below an initialised root (and
        at the first forward for one set below the root), during backward, or while a backward
        waits for its finalization."""
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
        """End the backward iteration under manual finalization: reduce what each unit holds
        (if it syncs), reshard (free where ``reshard_after_backward``), wait for the reductions
        and attach ``.grad``; with ``async_op=True`` return a :class:`GradientReductionHandle`
        whose ``wait()`` does the waiting and attaching. Before the root's first forward it does
        nothing. Raises ``RuntimeError`` (FSDP2's) without manual finalization, on a unit that
        is not the root, inside backward, or before a previous handle was waited for."""
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
        """True: a reshard keeps the unsharded parameters' storage (and the gathered buffer),
        so their data pointers stay the same across reshard and unshard (CUDA graph capture), at
        the cost of that memory between uses; the next gather refills it in place."""
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
        default, the previous unit in forward order). ``TypeError`` for a module not sharded."""
        self._fsdp_state.backward_prefetch = [_state_of(m) for m in modules]

    def to_empty(self, *, device, recurse: bool = True):
        """``nn.Module.to_empty``, as in FSDP2: a unit built under ``torch.device("meta")`` keeps
        its sharded parameters on meta until now; here each rank allocates only its shards on
        ``device`` (the parameter objects keep their identity). Then initialise them on the
        sharded model (``reset_parameters()`` of each module, ``module.apply(init_fn)``, or
        :func:`init_weights`, which matches an unsharded build under the same seed) or load a
        checkpoint. ``device`` must be of the mesh's device type (under CPU offload, the host or
        the mesh's device: the shards go to the host either way). Buffers and ignored
        parameters go through ``nn.Module.to_empty``."""
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
        """What ``nn.Module.to`` / ``double`` / ``float`` / ``half`` / ``cpu`` / ``cuda`` /
        ``to_empty`` run. The sharded parameters of every unit below follow the new dtype (see
        :func:`fsdp.group.convert.convert`: their buffers
        are rebuilt from the current values, the parameter objects keep their identity, explicit
        policy dtypes stay); everything else (buffers, ignored parameters) goes through
        ``nn.Module._apply``. The shards stay on the mesh's device: ``.to`` that device is a no-op,
        ``.to`` another one raises before anything changes. As in FSDP2, the unit is resharded
        first; call it between steps, not between forward and backward.
        """
        states = self._states(recurse)
        targets = {id(g): _conversion_target(fn, g) for state in states for g in state.groups}
        for state in states:  # every unit below is checked before any changes
            for group in state.groups:
                check_convert(group, *targets[id(group)])
        state = self._fsdp_state
        state.reshard()  # the sharded parameters registered (the unsharded ones are rebuilt)
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

    # ---------------------------------------------------------------- FSDP2 knobs (fsdp/unit/surface.py)

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

    # ---------------------------------------------------------------- Megatron surface

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
    """(dtype, device) that ``fn`` (an ``nn.Module._apply`` function) turns the group's main
    weights into, found by applying it to an empty tensor like them."""
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
    """Run the unit's forward hooks around ``module.<method_name>`` too (e.g. ``generate``),
    as torch FSDP2's function of the same name does: the weights are gathered before the method
    and resharded after it, like around ``forward``.

    ``module``: a module returned by ``fully_shard`` (else ``TypeError``); ``method_name``: the
    name of one of its methods (else ``AttributeError``). The method is replaced on this module
    object only; no collective runs until the method is called."""
    state = _state_of(module)
    method = getattr(module, method_name)

    @functools.wraps(method)
    def wrapped(*args, **kwargs):
        args, kwargs = state._pre_forward(module, args, kwargs)
        return state._post_forward(module, args, method(*args, **kwargs))

    setattr(module, method_name, wrapped)


def state_of_module(module: nn.Module) -> Optional[FSDPState]:
    """``fully_shard.state(module)``: the state of the unit ``module`` is a top module of (every
    module of a ``fully_shard([a, b])`` unit gives the same one), None if it is not one."""
    return module.__dict__.get("_fsdp_state") if isinstance(module, FSDPModule) else None


def fsdp_class(cls: type) -> type:
    if cls not in _CLASS_CACHE:
        _CLASS_CACHE[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    return _CLASS_CACHE[cls]


