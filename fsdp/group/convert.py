"""``module.to(...)`` on a sharded module, one group at a time (``FSDPModule._apply`` calls these):
the new dtypes, the checks that refuse before anything changes, and the rebuild itself.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Optional

import torch

from fsdp.group.meta_init import check_swappable, swap_in
from fsdp.group.policy import Dtypes, MixedPrecisionPolicy, converted

if TYPE_CHECKING:
    from fsdp.group.param_group import ParameterGroup

__all__ = ["accepts_device", "check_convert", "convert", "dtypes_after_to"]


def dtypes_after_to(group: ParameterGroup, dtype: torch.dtype) -> Dtypes:
    """The group's dtypes after ``module.to(dtype)``: main weights take ``dtype``, the ones the
    policy left None follow them as at ``fully_shard``, the ones it set stay."""
    if dtype == group.dtypes.main:
        return group.dtypes
    if not dtype.is_floating_point:
        return Dtypes(dtype, dtype, dtype, dtype)
    policy = group.policy if group.policy is not None else MixedPrecisionPolicy(main_params_dtype=None)
    return replace(policy, main_params_dtype=dtype).dtypes_for(dtype)


def accepts_device(group: ParameterGroup, device: torch.device) -> bool:
    """Whether ``device`` is where the shards live (or, under offload, the compute device)."""
    places = [group.main.device, group.compute_device] if group.offload.on_host else [group.main.device]
    return any(
        device.type == have.type and (None in (device.index, have.index) or device.index == have.index)
        for have in places
    )


def check_convert(group: ParameterGroup, dtype: torch.dtype, device: torch.device) -> None:
    """Raise ``ValueError``, changing nothing, if :func:`convert` cannot reach ``dtype`` on
    ``device``: shards stay on their mesh device (offloaded: the host, or name the compute one)."""
    device = torch.device(device)
    names = group.names()
    if not accepts_device(group, device):
        have = group.main.device
        if group.offload.on_host:
            raise ValueError(
                f"cannot move sharded parameters {names} to {device}: fully_shard's "
                f"CPUOffloadPolicy keeps them on the host ({have}) and computes on {group.compute_device}"
            )
        raise ValueError(
            f"cannot move sharded parameters {names} to {device}: fully_shard keeps each "
            f"rank's shards on its device of the mesh ({have}); build the mesh for "
            f"{device.type!r} and shard the module there"
        )
    if dtype == group.dtypes.main:
        return
    if group.weights.dtype_fixed is not None:
        raise ValueError(f"cannot convert parameters {names} to {dtype}: {group.weights.dtype_fixed}")
    if group.dtypes.main.is_floating_point and not dtype.is_floating_point:
        raise ValueError(f"cannot convert floating parameters {names} to {dtype}: pick a floating dtype")


@torch.no_grad()
def convert(group: ParameterGroup, dtype: Optional[torch.dtype] = None, device=None) -> bool:
    """``module.to(dtype)`` for one group: every buffer rebuilt in :func:`dtypes_after_to` from the
    current values (``device`` checked by :func:`check_convert`), parameters keeping their
    identity. Call between steps; raises ``RuntimeError`` inside ``init_weights``. Returns whether
    anything changed."""
    dtype = group.dtypes.main if dtype is None else dtype
    check_convert(group, dtype, group.main.device if device is None else device)
    dtypes = dtypes_after_to(group, dtype)
    if dtypes == group.dtypes:
        return False
    check_swappable(group)
    if group.initialising:
        raise RuntimeError("convert() inside init_weights: convert the module before or after")
    group.unsharder.wait_unshard()
    group.dtypes = dtypes
    group.main = group.offload.in_residence(converted(group.main, dtypes.main))
    group.replan()  # the weights are built, and the gradients rebuilt, for the new dtypes' plan
    group.build_weights()
    group.unsharder.rebuilt(group.streams)
    if group.grads is not None:
        group.grads.convert(dtypes, in_residence=group.offload.in_residence)
    swap_in(group.sharded_params, group.new_sharded_params())
    if group.grads is not None:
        group.grads.reattach_after_swap()
    return True
