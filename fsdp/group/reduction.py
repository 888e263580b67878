"""How a group's gradients are reduced: FSDP2's reduction knobs, as plain values.

``FSDPModule.set_gradient_divide_factor`` / ``set_force_sum_reduction_for_comms`` /
``set_requires_all_reduce`` / ``set_all_reduce_hook`` land here, one :class:`ReduceSettings` per
:class:`~fsdp.group.param_group.ParameterGroup`. The group reads them when it builds its gradient
buffer (the reduce op of its ``Partial`` placement) and compiles them into the steps a finished
reduction runs (:meth:`ReduceSettings.finishing`: divide, call the hook, divide) whenever they
change. All communication stays in :mod:`dbuffer`; a hook is the user's own code and may
communicate (e.g. a custom all-reduce across replicas), which is why it runs on every rank at the
same point of the backward.

What the hook sees, as in FSDP2: this rank's flat reduced gradient shard (1-D, padding included,
in the reduce dtype) after the reduce-scatter on a 1-D mesh and after the all-reduce across
replicas on an HSDP mesh; already divided unless sums are forced, in which case the division by
``divide_factor`` (default: the number of data-parallel ranks) follows the hook. Changes the hook
makes in place are what the gradient becomes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

import torch
from torch.distributed.device_mesh import DeviceMesh

if TYPE_CHECKING:
    from fsdp.group.streams import CommStreams, DeviceStream

__all__ = ["ReduceSettings", "check_divide_factor"]


@dataclass(frozen=True)
class ReduceSettings:
    """``divide_factor``: divide the summed gradients by this instead of averaging over the
    mesh (None: average). ``force_sum``: communicate with sum reductions only and divide after
    (FSDP2's ``set_force_sum_reduction_for_comms``). ``all_reduce``: on an HSDP mesh, all-reduce
    across replicas (False: reduce-scatter only, the partial sums wait for the next reduction
    that all-reduces). ``hook`` / ``hook_stream``: see the module docstring. ``unused_params``
    (FSDP2's ``set_reduce_scatter_unused_params``): attach the reduced gradient to every
    parameter of the group on every rank, also to one this rank's backward did not reach (its
    gradient may come from other ranks); False: only to those it reached."""

    divide_factor: Optional[float] = None
    force_sum: bool = False
    all_reduce: bool = True
    hook: Optional[Callable[[torch.Tensor], None]] = None
    hook_stream: Optional[DeviceStream] = None
    unused_params: bool = False  # True: every parameter gets the reduced gradient, zeros included

    @property
    def op(self) -> str:
        """The reduce op of the gradient buffer's ``Partial`` placements."""
        return "sum" if self.force_sum or self.divide_factor is not None else "avg"

    def finishing(self, mesh: DeviceMesh, streams: CommStreams) -> tuple[Callable[[torch.Tensor], None], ...]:
        """The steps that bring a finished reduction's output (in place) to the gradient FSDP2
        would produce, decided once for these settings (the reducer runs them, testing nothing;
        none by default): divide, the hook (on ``hook_stream``, ordered both ways against the
        current stream, through ``streams``, the device's :class:`~fsdp.group.streams.CommStreams`),
        divide after it when sums are forced."""
        steps: list[Callable[[torch.Tensor], None]] = []
        if self.divide_factor is not None and not self.force_sum:
            steps.append(functools.partial(_divide, factor=self.divide_factor))
        if self.hook is not None:
            hook, stream = self.hook, self.hook_stream
            steps.append(hook if stream is None else lambda reduced: streams.run_on(stream, lambda: hook(reduced)))
        if self.force_sum:
            factor = self.divide_factor if self.divide_factor is not None else float(mesh.size())
            if factor != 1:
                steps.append(functools.partial(_divide, factor=factor))
        return tuple(steps)


def _divide(reduced: torch.Tensor, factor: float) -> None:
    reduced.div_(factor)


def check_divide_factor(factor: object) -> float:
    """A positive real number (bools refused), as a float."""
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
        raise ValueError(f"the gradient divide factor must be a positive number, got {factor!r}")
    return float(factor)
