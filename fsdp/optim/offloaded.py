"""Optimizer steps over state kept on the host (``fsdp.OptimizerStateOffloadPolicy``).

A group with ``offload.optim_state`` (an :class:`~fsdp.group.residence.OptimStateHome`) keeps its
optimizer state on the host, its main weights and grads on the device. :func:`flat_offloaded_step`
streams :class:`fsdp.FlatOptimizer`'s flat state through the device chunk by chunk, or the weights
and grads to a kernel on the host. :class:`TorchStateOffload`, driven by
:mod:`fsdp.optim.step_hooks`, makes a ``torch.optim`` optimizer's parameter-shaped state DTensor
views of host buffers, uploaded whole around a device step (one group at a time for torch's
per-parameter optimizers), or steps host copies of the parameters and uploads the weights. State a
step or ``load_state_dict`` creates is moved into the host buffers after it.

Both end every step with the homes' ``settle``: when ``step()`` returns no copy is in flight.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp.group.residence import Chunk, OptimStateHome

__all__ = ["TorchStateOffload", "after_load_state_dict", "flat_offloaded_step", "rehome_flat"]


def rehome_flat(home: OptimStateHome, state: dict, names, flat: torch.Tensor, homes: dict) -> None:
    """Make ``homes[name]`` each state tensor ``names`` of ``flat``, copying in any loaded one."""
    for name in names:
        have, ours = state.get(name), homes.get(name)
        dtype = flat.dtype if have is None else have.dtype
        if ours is None or ours.dtype != dtype:
            ours = homes[name] = home.host_tensor(flat.numel(), dtype)
        if have is not ours:
            if have is not None:
                home.settle()
                ours.copy_(have.reshape(-1))
            state[name] = ours


def flat_offloaded_step(
    home: OptimStateHome, names, flat: torch.Tensor, grads: torch.Tensor, model: Optional[torch.Tensor],
    state: dict, chunks: list[Chunk], kernel: Callable,
) -> bool:
    """Step ``flat`` with its state on the host; returns whether ``model`` was written."""
    host_states = [state[n] for n in names]
    if home.step_on == "device":

        def on_device(c: Chunk, views: list[torch.Tensor]) -> None:
            weights = flat[c.start : c.end]
            kernel(weights, grads[c.grad_start : c.grad_start + c.numel], dict(zip(names, views)), c)
            if model is not None:
                model[c.start : c.end].copy_(weights)

        home.device_pass(host_states, chunks, on_device)
        return model is not None
    home.host_pass(flat, grads, host_states, chunks, lambda c, w, g, views: kernel(w, g, dict(zip(names, views)), c))
    return False


def _like(v: Any, p: torch.Tensor) -> bool:
    """Whether a state value is a tensor shaped like its parameter (offloaded), not a step count."""
    return (
        isinstance(v, DTensor) and v.is_floating_point() and v.shape == p.shape
        and v._local_tensor.shape == p._local_tensor.shape
    )


class _Entry:
    """One offloaded group among an optimizer's parameters."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.home: OptimStateHome = group.offload.optim_state
        self.members: list[tuple[int, int, int, nn.Parameter]] = []  # (index in group, param group, position, param)
        self.homes: dict[tuple, tuple[Any, list]] = {}  # (name, dtype) -> host DBuffer, its views
        self.device: dict[tuple, tuple[Any, list]] = {}  # during a device step: device DBuffer, its views
        self.weights = self.grads = None  # host step: host DBuffers of the weights and gradients
        self.shadows: dict[int, nn.Parameter] = {}  # host step: the host parameter of each member
        self.index: dict[int, int] = {}  # id(sharded parameter) -> its index in the group

    def home_views(self, name: str, dtype: torch.dtype) -> list:
        key = (name, dtype)
        if key not in self.homes:
            g = self.group
            buf = self.home.host_buffer(g.mesh, g.main.placements, g.main.shapes, dtype, g.main.layout)
            self.homes[key] = (buf, g.sharded_views(buf))
        return self.homes[key][1]


class TorchStateOffload:
    """What the step hooks do for one optimizer with offloaded groups; holds no reference to it."""

    def __init__(self, entries: list[_Entry]) -> None:
        self.entries = entries
        self._swapped: list[tuple[int, int, nn.Parameter, nn.Parameter]] = []  # (param group, position, param, host param)
        self._lists: Optional[list[list]] = None  # the param groups' own lists while the step sees fewer
        self._alone = False  # this step's device groups were stepped one at a time, in before_step

    @staticmethod
    def of(optimizer: torch.optim.Optimizer) -> Optional["TorchStateOffload"]:
        """The plan for ``optimizer``, or None when none of its parameters' groups offloads state."""
        entries: dict[int, _Entry] = {}
        for i, param_group in enumerate(optimizer.param_groups):
            for pos, p in enumerate(param_group["params"]):
                ref = getattr(p, "_fsdp_group", None)
                group = ref() if ref is not None else None
                if group is None or group.offload.optim_state is None:
                    continue
                entry = entries.get(id(group))
                if entry is None:
                    entry = entries[id(group)] = _Entry(group)
                    entry.index = {id(q): k for k, q in enumerate(group.sharded_params)}
                entry.members.append((entry.index[id(p)], i, pos, p))
        if not entries:
            return None
        _watch_loads(optimizer)
        return TorchStateOffload(list(entries.values()))

    def before_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        """Move state to where the step runs; step per-parameter optimizers' device groups here."""
        self.restore(optimizer)  # a step that raised left the host parameters in place
        on_host = [e for e in self.entries if e.home.step_on == "host"]
        if on_host:
            _check_host_step(optimizer, args, kwargs)
        on_device = [e for e in self.entries if e.home.step_on == "device"]
        inner = getattr(type(optimizer).step, "__wrapped__", None)  # the step without the hooks
        closure = args[1] if len(args) > 1 else kwargs.get("closure")
        alone = bool(on_device) and type(optimizer) in _PER_PARAMETER and inner is not None and closure is None
        self._alone = alone
        for e in self.entries:
            e.home.settle()
            self._rehome(optimizer, e)
            if e.home.step_on == "host":
                self._download_weights(e)
            elif not alone:
                self._upload_states(optimizer, e)
        self._swap_in(optimizer, on_host)
        if alone:
            self._step_alone(optimizer, on_device, lambda: inner(*args, **kwargs))

    def _step_alone(self, optimizer: torch.optim.Optimizer, entries: list[_Entry], inner: Callable[[], Any]) -> None:
        """Step each group alone with only its state on the device; the real step does the rest."""
        self._lists = [param_group["params"] for param_group in optimizer.param_groups]
        for e in entries:
            mine = {(i, pos) for _, i, pos, _ in e.members}
            for i, param_group in enumerate(optimizer.param_groups):
                param_group["params"] = [p for pos, p in enumerate(self._lists[i]) if (i, pos) in mine]
            self._upload_states(optimizer, e)
            inner()  # the step's own arguments (a GradScaler's), no hooks
            self._send_back(optimizer, e)
        done = {(i, pos) for e in entries for _, i, pos, _ in e.members}
        for i, param_group in enumerate(optimizer.param_groups):
            param_group["params"] = [p for pos, p in enumerate(self._lists[i]) if (i, pos) not in done]

    def _swap_in(self, optimizer: torch.optim.Optimizer, on_host: list[_Entry]) -> None:
        """Host step: the host parameters in place of the device ones, in the param groups' lists."""
        for e in on_host:
            e.home.settle()  # the host reads the weights and gradients now
            for k, i, pos, p in e.members:
                shadow = e.shadows[k]
                optimizer.param_groups[i]["params"][pos] = shadow
                if p in optimizer.state:
                    state = optimizer.state[shadow] = optimizer.state.pop(p)
                    for name, v in state.items():
                        # a fused kernel's step count, loaded by the device parameter: to the host
                        if isinstance(v, torch.Tensor) and not _like(v, p):
                            state[name] = v.to(shadow.device)
                self._swapped.append((i, pos, p, shadow))

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Send the state back to the host (device step) or the weights to the device (host step)."""
        self.restore(optimizer)
        for e in self.entries:
            if e.home.step_on == "host":
                e.home.settle()
                e.home.copy(e.group.main.local_buffer, e.weights.local_buffer)
                self._rehome(optimizer, e)  # what the step created (its first)
            elif not self._alone:  # stepped by the optimizer's own step (not already by _step_alone)
                self._send_back(optimizer, e)
        for e in self.entries:
            e.home.settle()

    def _send_back(self, optimizer: torch.optim.Optimizer, e: _Entry) -> None:
        """After a device step of ``e``: its state back into the host buffers, the device's freed."""
        e.home.settle()  # the uploads are done before the host buffers are written
        self._download_states(optimizer, e)
        self._rehome(optimizer, e)  # what the step created (its first)
        e.home.settle()
        for buf, _ in e.device.values():
            buf.release_storage()
        e.device.clear()

    def restore(self, optimizer: torch.optim.Optimizer) -> None:
        """Give ``optimizer`` its own parameter lists and device parameters back."""
        lists, self._lists = self._lists, None
        if lists is not None:
            for param_group, params in zip(optimizer.param_groups, lists):
                param_group["params"] = params
        swapped, self._swapped = self._swapped, []
        for i, pos, p, shadow in swapped:
            optimizer.param_groups[i]["params"][pos] = p
            if shadow in optimizer.state:
                optimizer.state[p] = optimizer.state.pop(shadow)
            shadow.grad = None

    def rehome_all(self, optimizer: torch.optim.Optimizer) -> None:
        """After ``load_state_dict``: the loaded state into the host buffers."""
        for e in self.entries:
            e.home.settle()
            self._rehome(optimizer, e)

    @torch.no_grad()
    def _rehome(self, optimizer: torch.optim.Optimizer, e: _Entry) -> None:
        for k, _, _, p in e.members:
            state = optimizer.state.get(p)
            for name, v in list((state or {}).items()):
                if not _like(v, p):
                    continue
                view = e.home_views(name, v.dtype)[k]
                if v is not view:
                    view._local_tensor.copy_(v._local_tensor)
                    state[name] = view

    def _upload_states(self, optimizer: torch.optim.Optimizer, e: _Entry) -> None:
        g = e.group
        for (name, dtype), (buf, views) in e.homes.items():
            device = g.sibling(g.main.placements, dtype, zero_fill=False)
            e.home.copy(device.local_buffer, buf.local_buffer)
            device_views = g.sharded_views(device)
            e.device[(name, dtype)] = (device, device_views)
            for k, _, _, p in e.members:
                state = optimizer.state.get(p)
                if state is not None and state.get(name) is views[k]:
                    state[name] = device_views[k]

    def _download_states(self, optimizer: torch.optim.Optimizer, e: _Entry) -> None:
        for key, (device, device_views) in e.device.items():
            buf, views = e.homes[key]
            e.home.copy(buf.local_buffer, device.local_buffer)
            for k, _, _, p in e.members:
                state = optimizer.state.get(p)
                if state is not None and state.get(key[0]) is device_views[k]:
                    state[key[0]] = views[k]

    def _download_weights(self, e: _Entry) -> None:
        g = e.group
        if e.weights is None:
            main = g.main
            e.weights = e.home.host_buffer(g.mesh, main.placements, main.shapes, main.dtype, main.layout)
            e.grads = e.home.host_buffer(g.mesh, main.placements, main.shapes, main.dtype, main.layout)
            e.grad_views = g.sharded_views(e.grads)
            weight_views = g.sharded_views(e.weights)
            e.shadows = {k: nn.Parameter(weight_views[k], requires_grad=p.requires_grad) for k, _, _, p in e.members}
        e.home.copy(e.weights.local_buffer, g.main.local_buffer)
        for k, _, _, p in e.members:
            shadow = e.shadows[k]
            if p.grad is None:
                shadow.grad = None
                continue
            e.home.copy(e.grad_views[k]._local_tensor, p.grad._local_tensor)
            shadow.grad = e.grad_views[k]


def _check_host_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    closure = args[1] if len(args) > 1 else kwargs.get("closure")
    if closure is not None:
        raise RuntimeError(
            f"{type(optimizer).__name__}.step(closure): OptimizerStateOffloadPolicy(step='host') steps host "
            f"copies of the parameters, which a closure's forward and backward would not see; step without "
            f"a closure, or use step='device'"
        )
    for i, param_group in enumerate(optimizer.param_groups):
        if param_group.get("capturable"):
            raise RuntimeError(
                f"{type(optimizer).__name__}: param_groups[{i}] has capturable=True, which needs the parameters "
                f"on the device; OptimizerStateOffloadPolicy(step='host') steps on the host: build the optimizer "
                f"with capturable=False, or use step='device'"
            )


# torch.optim's optimizers stepping each parameter alone (not subclasses, which may step across
# parameters): stepped one fsdp group at a time.
_PER_PARAMETER = {
    getattr(torch.optim, name) for name in (
        "Adadelta", "Adafactor", "Adagrad", "Adam", "Adamax", "AdamW", "ASGD", "NAdam", "RAdam", "RMSprop",
        "Rprop", "SGD", "SparseAdam",
    ) if hasattr(torch.optim, name)
}

# Optimizers whose load_state_dict already puts loaded state into the host buffers.
_WATCHED: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
# Each optimizer's current plan (fsdp.optim.step_hooks keeps it up to date).
PLANS: "weakref.WeakKeyDictionary[torch.optim.Optimizer, Optional[TorchStateOffload]]" = weakref.WeakKeyDictionary()


def _watch_loads(optimizer: torch.optim.Optimizer) -> None:
    if optimizer not in _WATCHED:
        optimizer.register_load_state_dict_post_hook(after_load_state_dict)
        _WATCHED.add(optimizer)


def after_load_state_dict(optimizer: torch.optim.Optimizer) -> None:
    """Copy a loaded state dict's tensors into the host buffers at once, not at the next step."""
    plan = PLANS.get(optimizer)
    if plan is not None:
        plan.rehome_all(optimizer)
