"""``FsdpParameterGroup``: one fsdp :class:`~fsdp.ParameterGroup` under Megatron-FSDP's names.

fsdp builds and runs the group (one dtype, one ``requires_grad``, one flat row-atomic buffer per
state). This view shows its buffers as Megatron-FSDP's :class:`~fsdp.megatron.buffer.DBuffer` s,
without copying them:

* ``main_weight``: the main weights the optimizer updates, at the optimizer placement (the
  registered parameters are DTensor views of it);
* ``main_grad``: the reduced gradients at their placement (None for a group that does not
  require grad); its storage exists from a step's first reduction until the optimizer drops the
  gradients, as in fsdp;
* ``model_weight``: the compute weights at the parameter placement: ``main_weight`` itself where
  the dtypes and placements agree; the gathered weights of ``optim`` / ``optim_grads`` and the
  compute-dtype shard where fsdp keeps one (HFSDP), while they are current; else, since fsdp
  casts the main shard straight into its gather, a cast of ``main_weight`` made when read (the
  values Megatron-FSDP's buffer would hold);
* ``_unsharded_model_weight``: the gathered weights the modules compute with (storage only
  between a unit's gather and its reshard under ZeRO-3).

:meth:`FsdpParameterGroup.sync_model_weight_from_main_weight` is Megatron-FSDP's refresh after
the main weights changed (an optimizer step, an initialisation): the next forward casts and
gathers them (fsdp's ``mark_stale``). ``fsdp_parameters`` lists each physical parameter with
every name it is registered under (tied weights: one parameter, several names).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

import dbuffer
import fsdp
from fsdp.megatron.buffer import DBuffer

__all__ = [
    "FsdpParameter",
    "FsdpParameterGroup",
    "ParameterGroups",
    "get_containing_parameter_group",
    "sync_model_weights_from_main_weights",
]

_GROUP_ATTR = "_mfsdp_parameter_group"


@dataclass(frozen=True, eq=False)
class FsdpParameter:
    """One physical parameter: ``fqns``, every name it is registered under (relative to the
    unit's module; tied weights have several); ``sharded``, the DTensor parameter the optimizer
    holds (a view of the group's main weights); ``unsharded``, the plain parameter the modules
    compute with between a gather and a reshard. A plain value, built by
    :attr:`FsdpParameterGroup.fsdp_parameters`; raises nothing."""

    fqns: tuple[str, ...]
    sharded: nn.Parameter
    unsharded: nn.Parameter


class ParameterGroups(tuple):
    """A unit's parameter groups: a tuple (Megatron-LM main's ``parameter_groups``) that is also
    callable, returning itself (megatron-fsdp 0.6.1's ``parameter_groups()``)."""

    def __call__(self) -> "ParameterGroups":
        return self


def get_containing_parameter_group(parameter: nn.Parameter) -> Optional["FsdpParameterGroup"]:
    """The :class:`FsdpParameterGroup` whose sharded parameter ``parameter`` is (what
    ``model.parameters()`` gives after :func:`fsdp.megatron.fully_shard`), or None for any other
    tensor, or once the group is gone (the parameter holds it weakly). A query: it raises
    nothing and changes nothing."""
    ref = getattr(parameter, _GROUP_ATTR, None)
    return ref() if ref is not None else None


def sync_model_weights_from_main_weights(parameters: Iterable[nn.Parameter]) -> None:
    """Call :meth:`FsdpParameterGroup.sync_model_weight_from_main_weight` once for each group
    among ``parameters`` (in their order of first appearance); parameters of no group are
    skipped (tensors that are not sharded parameters included). What
    :func:`fsdp.megatron.fully_shard_optimizer` runs after each step; raises what a group's sync
    raises (nothing of its own)."""
    seen: set[int] = set()
    for p in parameters:
        group = get_containing_parameter_group(p)
        if group is not None and id(group) not in seen:
            seen.add(id(group))
            group.sync_model_weight_from_main_weight()


class FsdpParameterGroup:
    """One fsdp group under Megatron-FSDP's names (see the module docstring). Built by
    :func:`fsdp.megatron.fully_shard`: ``group`` the fsdp group, ``module`` the unit, ``mesh``
    the user's mesh, ``fqns`` every parameter's names, ``grad_divisor`` the extra division of
    its gradients. Its attributes are views and queries: they raise nothing of their own (a
    ``DBuffer`` view raises what :meth:`fsdp.megatron.DBuffer.wrap` raises for a buffer it
    cannot state)."""

    def __init__(
        self, group: fsdp.ParameterGroup, module: nn.Module, mesh: DeviceMesh, fqns: list[tuple[str, ...]], grad_divisor: int
    ) -> None:
        self._group = group
        self._owning_module = weakref.ref(module)
        self.mesh = mesh
        self.grad_divisor = grad_divisor
        self._fqns = tuple(fqns)
        self._views: dict[str, tuple[dbuffer.DBuffer, DBuffer]] = {}  # role -> (fsdp's buffer, its view)
        for p in group.sharded_params:
            setattr(p, _GROUP_ATTR, weakref.ref(self))

    # ------------------------------------------------------------------ what it holds

    @property
    def fsdp_group(self) -> fsdp.ParameterGroup:
        """The fsdp group this is a view of."""
        return self._group

    @property
    def owning_module(self) -> Optional[nn.Module]:
        """The unit's module (None once it is gone)."""
        return self._owning_module()

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the parameters compute in (the one they were built in)."""
        return self._group.dtypes.model

    @property
    def requires_grad(self) -> bool:
        """Whether the group's parameters are trained (a frozen group has no main grads)."""
        return self._group.requires_grad

    @property
    def fsdp_parameters(self) -> tuple[FsdpParameter, ...]:
        """Each physical parameter with its names, sharded and unsharded parameters."""
        g = self._group
        unsharded = g.unsharded_params or [None] * len(self._fqns)
        return tuple(FsdpParameter(f, s, u) for f, s, u in zip(self._fqns, g.sharded_params, unsharded))

    @property
    def parameter_names(self) -> tuple[str, ...]:
        """Each parameter's first name (megatron-fsdp 0.6.1)."""
        return tuple(f[0] for f in self._fqns)

    @property
    def sharded_parameters(self) -> tuple[nn.Parameter, ...]:
        """The sharded DTensor parameters (megatron-fsdp 0.6.1)."""
        return tuple(self._group.sharded_params)

    @property
    def unsharded_parameters(self) -> tuple[nn.Parameter, ...]:
        """The unsharded parameters (megatron-fsdp 0.6.1)."""
        return tuple(self._group.unsharded_params or ())

    # ------------------------------------------------------------------ buffers

    def _view(self, role: str, inner: dbuffer.DBuffer) -> DBuffer:
        """The Megatron view of fsdp's buffer ``inner`` in ``role``: the same object while fsdp
        keeps that buffer (one that replaced it, after ``module.to``, gets a new view)."""
        hit = self._views.get(role)
        if hit is None or hit[0] is not inner:
            same = next((v for b, v in self._views.values() if b is inner), None)  # main is also model
            hit = self._views[role] = (inner, same if same is not None else DBuffer.wrap(inner, self.mesh))
        return hit[1]

    @property
    def main_weight(self) -> DBuffer:
        """The main weights at the optimizer placement (the same view while the buffer lives)."""
        return self._view("main", self._group.main)

    @property
    def main_grad(self) -> Optional[DBuffer]:
        """The reduced gradients at their placement; None for a frozen group."""
        grads = self._group.grads
        return None if grads is None else self._view("main_grad", grads.main_grad)

    @property
    def model_weight(self) -> DBuffer:
        """The compute weights at the parameter placement (see the module docstring)."""
        g = self._group
        weights = g.weights
        if weights.model is g.main and g.strategy.shard_params:
            return self.main_weight
        if g.unsharder.is_current():
            if not g.strategy.shard_params:
                return self._view("unsharded", weights.unsharded)
            if not weights.model.is_storage_released():
                return self._view("model", weights.model)
        return DBuffer.wrap(g.main.cast(g.dtypes.model), self.mesh)

    @property
    def _unsharded_model_weight(self) -> DBuffer:
        """The gathered weights the modules compute with (Megatron-FSDP's private name)."""
        return self._view("unsharded", self._group.weights.unsharded)

    def sync_model_weight_from_main_weight(self) -> None:
        """The main weights changed: the next forward casts and gathers them afresh."""
        self._group.unsharder.mark_stale()

    def __repr__(self) -> str:
        return f"FsdpParameterGroup({list(self.parameter_names)}, dtype={self.dtype}, requires_grad={self.requires_grad})"
