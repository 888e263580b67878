"""``module.to(...)`` on a sharded module, for :class:`~fsdp.group.param_group.ParameterGroup`: the :class:`DtypeConversion` mixin.

What it owns: the group's dtypes after ``module.to(dtype)`` (the policy's explicit dtypes stay,
the unset ones follow the main weights), the checks that refuse a conversion before anything
changes (the shards stay on this rank's device of the mesh, or on the host under offload), and
the conversion itself: every buffer rebuilt in its new dtype from the current values, the
sharded parameters keeping their identity. Called by
``FSDPModule._apply`` (:mod:`fsdp.unit.module`).

Why a mixin: the conversion rebuilds the group's own buffers (main, compute, gradient) and
re-hooks and re-attaches its parameters, so it needs the whole group as ``self``; subclasses
(:mod:`fsdp.compose.extensions`) override :meth:`DtypeConversion.check_convert` / ``convert`` and call
``super()`` (the same reasoning as :class:`fsdp.group.meta_init.MetaInit`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from fsdp.group.grads import converted
from fsdp.group.policy import Dtypes, MixedPrecisionPolicy

__all__ = ["DtypeConversion"]


class DtypeConversion:
    """Mixin of :class:`~fsdp.group.param_group.ParameterGroup`: ``module.to(dtype / device)`` for its buffers."""

    def dtypes_after_to(self, dtype: torch.dtype) -> Dtypes:
        """The group's dtypes after ``module.to(dtype)``: the main weights (the registered
        parameters) take ``dtype``; the dtypes the policy left unset (``param_dtype``,
        ``main_grads_dtype``, ``reduce_dtype`` of None) follow them as they did at
        ``fully_shard``, the ones it set stay."""
        if dtype == self.dtypes.main:
            return self.dtypes
        if not dtype.is_floating_point:
            return Dtypes(dtype, dtype, dtype, dtype)
        policy = self.policy if self.policy is not None else MixedPrecisionPolicy(main_params_dtype=None)
        return replace(policy, main_params_dtype=dtype).dtypes_for(dtype)

    def check_convert(self, dtype: torch.dtype, device: torch.device) -> None:
        """Raise, changing nothing, if :meth:`convert` cannot take the group to ``dtype`` on
        ``device``: the shards stay on this rank's device of the mesh (no offload). Under CPU
        offload they stay on the host, and ``device`` may be the host or the compute device
        (``module.to(device)`` then moves only the module's buffers)."""
        device = torch.device(device)
        if not self.accepts_device(device):
            have = self.main.device
            if self.offload.on_host:
                raise ValueError(
                    f"cannot move sharded parameters {self._names()} to {device}: fully_shard's "
                    f"CPUOffloadPolicy keeps them on the host ({have}) and computes on {self.compute_device}"
                )
            raise ValueError(
                f"cannot move sharded parameters {self._names()} to {device}: fully_shard keeps each "
                f"rank's shards on its device of the mesh ({have}); build the mesh for "
                f"{device.type!r} and shard the module there"
            )
        if dtype != self.dtypes.main and self.dtypes.main.is_floating_point and not dtype.is_floating_point:
            raise ValueError(f"cannot convert floating parameters {self._names()} to {dtype}: pick a floating dtype")

    def accepts_device(self, device: torch.device) -> bool:
        """Whether ``device`` is where the shards live (or, under offload, the compute device)."""
        places = [self.main.device, self.compute_device] if self.offload.on_host else [self.main.device]
        return any(
            device.type == have.type and (None in (device.index, have.index) or device.index == have.index)
            for have in places
        )

    @torch.no_grad()
    def convert(self, dtype: Optional[torch.dtype] = None, device=None) -> bool:
        """``module.to(dtype)`` for this group: rebuild every buffer in the new dtypes
        (:meth:`dtypes_after_to`) from the current values (main weights, gradients held or
        reduced), on the same device (``device`` is checked, see :meth:`check_convert`).
        The sharded parameters keep their identity (their contents are swapped, as
        ``nn.Module._apply`` does for DTensor parameters), so references to them stay valid;
        state an optimizer already made for them keeps its old dtype. The model weights are
        refreshed at the next unshard. Call between steps, not between forward and backward.
        Returns whether anything changed."""
        dtype = self.dtypes.main if dtype is None else dtype
        self.check_convert(dtype, self.main.device if device is None else device)
        dtypes = self.dtypes_after_to(dtype)
        if dtypes == self.dtypes:
            return False
        self._check_swappable()
        if self._init_buffer is not None:
            raise RuntimeError("convert() inside init_weights: convert the module before or after")
        self.wait_unshard()
        self.dtypes = dtypes
        self.main = converted(self.main, dtypes.main)
        self.main = self.offload.adopt(self.main)
        self._build_compute_buffers()
        self._gathered = None
        self.mark_stale()
        if self.grads is not None:
            self.grads.convert(dtypes, adopt=self.offload.adopt)
        self._swap_in(self._new_sharded_params())
        if self.grads is not None:
            self.grads.reattach_after_swap()
        return True
