"""The fastest correct way to run each collective on each backend, on flat 1-D tensors.

This is the only module of the toolkit that calls torch.distributed collectives.

* All-gather: ``dist.all_gather_single`` everywhere.
* Reduce-scatter: NCCL (and torch's threaded test group) run ``reduce_scatter_single``. Gloo runs
  that as a full all-reduce; an all-to-all followed by a local sum moves the same bytes as a true
  reduce-scatter and measured about 3x faster for 32 MiB of fp32 (``tools/bench_primitives.py``).
  The all-to-all needs a receive workspace the size of the input.
* ``avg``: native where the backend has ``ReduceOp.AVG`` (NCCL, threaded); elsewhere a sum and an
  in-place division by the group size on the (already reduced, smaller) output.

Every function writes into the ``out`` it is given and returns a :class:`Pending` whose
``wait()`` finishes the work (post-processing included) and returns ``out``.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

__all__ = ["Pending", "all_gather", "all_reduce", "reduce_scatter"]

_NATIVE_AVG_BACKENDS = ("nccl", "threaded")


class Pending:
    """Work in flight. ``wait()`` blocks (on CUDA: orders the current stream) and returns the result."""

    def __init__(self, works: list, finish: Callable[[], object]) -> None:
        self._works = works
        self._finish = finish
        self._result: object = None
        self._done = False

    def wait(self):
        if not self._done:
            for work in self._works:
                if work is not None:
                    work.wait()
            self._result = self._finish()
            self._done = True
        return self._result

    def is_completed(self) -> bool:
        return self._done or all(w is None or w.is_completed() for w in self._works)


def _backend(group: dist.ProcessGroup) -> str:
    return str(dist.get_backend(group)).lower()


def _reduce_op(op: str, group: dist.ProcessGroup) -> tuple[dist.ReduceOp, bool]:
    """The c10d op to issue, and whether the result must still be divided by the group size."""
    if op == "sum":
        return dist.ReduceOp.SUM, False
    if op == "avg":
        if _backend(group) in _NATIVE_AVG_BACKENDS:
            return dist.ReduceOp.AVG, False
        return dist.ReduceOp.SUM, True
    raise ValueError(f"reduce op must be 'sum' or 'avg', got {op!r}")


def _div_by(size: int, t: torch.Tensor) -> Callable[[], torch.Tensor]:
    def finish() -> torch.Tensor:
        return t.div_(size)

    return finish


def all_gather(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False) -> Pending:
    """Concatenate every rank's ``inp`` into ``out`` (``out.numel() == size * inp.numel()``)."""
    work = dist.all_gather_single(out, inp, group=group, async_op=async_op)
    return _maybe_wait(Pending([work], lambda: out), async_op)


def reduce_scatter(
    out: torch.Tensor, inp: torch.Tensor, op: str, group: dist.ProcessGroup, async_op: bool = False
) -> Pending:
    """``out`` = chunk ``group rank`` of the reduction over ranks of ``inp``."""
    size = dist.get_world_size(group)
    c10d_op, divide = _reduce_op(op, group)
    if _backend(group) == "gloo" and size > 1:
        received = torch.empty_like(inp)
        work = dist.all_to_all_single(received, inp, group=group, async_op=async_op)

        def finish() -> torch.Tensor:
            torch.sum(received.view(size, -1), dim=0, out=out)
            return out.div_(size) if divide else out

        return _maybe_wait(Pending([work], finish), async_op)
    work = dist.reduce_scatter_single(out, inp, op=c10d_op, group=group, async_op=async_op)
    return _maybe_wait(Pending([work], _div_by(size, out) if divide else (lambda: out)), async_op)


def all_reduce(t: torch.Tensor, op: str, group: dist.ProcessGroup, async_op: bool = False) -> Pending:
    """Reduce ``t`` in place over the group."""
    c10d_op, divide = _reduce_op(op, group)
    work = dist.all_reduce(t, op=c10d_op, group=group, async_op=async_op)
    size = dist.get_world_size(group)
    return _maybe_wait(Pending([work], _div_by(size, t) if divide else (lambda: t)), async_op)


def _maybe_wait(pending: Pending, async_op: bool) -> Pending:
    if not async_op:
        pending.wait()
    return pending
