"""How a group's gradients are reduced: FSDP2's reduction knobs (``FSDPModule.set_*``) as plain
values, compiled into the steps a finished reduction runs (:meth:`ReduceSettings.finishing`).

The hook, as in FSDP2, sees this rank's flat reduced shard (padding included) after the last
collective, divided unless sums are forced; its in-place changes are what the gradient becomes.
It may communicate, which is why it runs on every rank at the same point.
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
    """``divide_factor``: divide sums by this instead of averaging (None). ``force_sum``: sum
    reductions only, divide after. ``all_reduce``: on HSDP, all-reduce across replicas (False:
    partial sums wait for a later one). ``hook`` / ``hook_stream``: see the module docstring.
    ``unused_params``: attach gradients also to parameters this rank's backward did not reach."""

    divide_factor: Optional[float] = None
    force_sum: bool = False
    all_reduce: bool = True
    hook: Optional[Callable[[torch.Tensor], None]] = None
    hook_stream: Optional[DeviceStream] = None
    unused_params: bool = False

    @property
    def op(self) -> str:
        """The reduce op of the gradient buffer's ``Partial`` placements."""
        return "sum" if self.force_sum or self.divide_factor is not None else "avg"

    def finishing(self, mesh: DeviceMesh, streams: CommStreams) -> tuple[Callable[[torch.Tensor], None], ...]:
        """In-place steps that bring a finished reduction to FSDP2's gradient, decided once so the
        reducer tests nothing: divide, the hook (on ``hook_stream``, ordered both ways through
        ``streams``), divide after it when sums are forced (by the ``mesh`` size by default)."""
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
    """``factor`` as a float; raises ``ValueError`` unless a positive number (bools refused)."""
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
        raise ValueError(f"the gradient divide factor must be a positive number, got {factor!r}")
    return float(factor)
