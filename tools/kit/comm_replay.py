"""Replay the c10d calls of one training step with nothing else: the raw-c10d reference of
``tools/bench_fsdp.py``.

A training step's communication is recorded as the sequence of ``torch.distributed`` calls it
made (function, arguments, with every tensor reduced to its shape and dtype) and replayed on
preallocated tensors of those shapes, straight through c10d: no model, no framework, no copies,
casts or local sums around the calls. What the replay costs is what the communication itself
costs on this host, so ``floor + replay`` is the fastest a data-parallel step can be where the
compute already fills every core (the communication cannot hide behind it).

The replay keeps the step's grouping into operations (the isend/irecv calls of one
point-to-point all-gather are posted together) and waits for each operation before posting the
next: no overlap between operations, which is the raw cost the benchmark wants. Every rank must
replay a trace recorded in the same step, as it must run the step itself: the trace is only as
symmetric as the communication it recorded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map


@dataclass(frozen=True)
class TensorSpec:
    """What the replay needs of a tensor argument: a fresh contiguous tensor of this shape."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class Call:
    """One recorded c10d call: ``torch.distributed.<name>(**arguments)``; ``new_op`` says it
    starts an operation (a collective, or the first isend/irecv of a point-to-point exchange)."""

    name: str
    arguments: dict[str, Any]
    new_op: bool


def record(name: str, arguments: dict[str, Any], new_op: bool) -> Call:
    """The call with every tensor (also inside lists) replaced by its :class:`TensorSpec`.
    Process groups, ranks and reduce ops are kept as they are."""
    def spec(x: Any) -> Any:
        return TensorSpec(tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x

    return Call(name, tree_map(spec, dict(arguments)), new_op)


class Replay:
    """The recorded calls, bound to tensors allocated once (zeros). Within one operation every
    tensor argument gets its own tensor; operations reuse them, so the replay holds about the
    largest operation's bytes, not the whole step's."""

    def __init__(self, calls: list[Call]) -> None:
        if not calls:
            raise ValueError("Replay: no calls were recorded (the traced step made no c10d call)")
        self._pool: dict[tuple, torch.Tensor] = {}
        self.calls: list[tuple[str, dict[str, Any], bool]] = []
        slot = 0
        for call in calls:
            slot = 0 if call.new_op else slot

            def bind(x: Any) -> Any:
                nonlocal slot
                if not isinstance(x, TensorSpec):
                    return x
                key = (slot, x.shape, x.dtype)
                slot += 1
                if key not in self._pool:
                    self._pool[key] = torch.zeros(x.shape, dtype=x.dtype)
                return self._pool[key]

            self.calls.append((call.name, tree_map(bind, call.arguments), call.new_op))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._pool.values())

    def run(self) -> None:
        """Post every call in order, through ``torch.distributed`` (so wrappers see them), and
        wait for each operation's works before the next operation starts."""
        pending: list = []
        for name, arguments, new_op in self.calls:
            if new_op:
                _wait(pending)
            work = getattr(dist, name)(**arguments)
            if work is not None and hasattr(work, "wait"):
                pending.append(work)
        _wait(pending)


def _wait(pending: list) -> None:
    for work in pending:
        work.wait()
    pending.clear()
