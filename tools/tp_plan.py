"""The Llama / Mixtral tensor-parallel plan the memory planner and the layout picture assume, and
the N-D mesh shape ``(dp_replicate, dp_shard, tp)`` they take.

The plan is torchtitan's for Llama (by module name, Hugging Face spelling, so it also covers
Mixtral's experts):

* column-parallel (``ColwiseParallel``: the weight ``[out, in]`` split on dim 0): ``q_proj``,
  ``k_proj``, ``v_proj``, ``gate_proj``, ``up_proj``, the experts' ``w1`` and ``w3``, and the output
  head ``lm_head`` (split on the vocabulary);
* row-parallel (``RowwiseParallel``: split on dim 1 for a Linear): ``o_proj``, ``down_proj``, the
  experts' ``w2``; and the embedding ``embed_tokens``, which ``RowwiseParallel`` splits on dim 0
  (the vocabulary) as torchtitan does;
* everything else (RMSNorm weights, Mixtral's router ``gate``) stays a plain tensor, replicated on
  every TP rank, and is sharded on the data-parallel axes only.

A TP-split weight's local piece on TP rank ``t`` is ``torch.chunk(weight, tp, dim)[t]``: that is
what ``parallelize_module`` keeps (DTensor's ``Shard`` placement), and what the planner's closed
form divides by (:func:`local_shape`), independently of fsdp.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.nn as nn

__all__ = ["COLWISE", "ROWWISE", "MeshShape", "tp_dim", "tp_plan", "local_shape"]

COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "w1", "w3", "lm_head")
ROWWISE = ("o_proj", "down_proj", "w2", "embed_tokens")


@dataclass(frozen=True)
class MeshShape:
    """``world = dp_replicate * dp_shard * tp`` ranks; rank ``r`` sits at ``(r // (dp_shard*tp),
    r // tp % dp_shard, r % tp)`` (row-major, like ``init_device_mesh``)."""

    dp_replicate: int
    dp_shard: int
    tp: int

    @classmethod
    def of(cls, world: int, tp: int = 1, dp_replicate: int = 1) -> "MeshShape":
        for name, value in (("world", world), ("tp", tp), ("dp_replicate", dp_replicate)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if world % (tp * dp_replicate):
            raise ValueError(
                f"world {world} is not divisible by tp * dp_replicate = {tp} * {dp_replicate}; pick sizes whose "
                f"product divides the world (dp_shard = world / (tp * dp_replicate))"
            )
        return cls(dp_replicate, world // (tp * dp_replicate), tp)

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp

    @property
    def is_1d(self) -> bool:
        return self.tp == 1 and self.dp_replicate == 1

    def names(self) -> tuple[str, ...]:
        """Mesh axis names, leaving out size-1 replicate and tp axes."""
        return tuple(n for n in ("dp_replicate", "dp_shard", "tp") if n == "dp_shard" or getattr(self, n) > 1)

    def sizes(self) -> tuple[int, ...]:
        return tuple(getattr(self, n) for n in self.names())

    def dp_names(self) -> tuple[str, ...]:
        return tuple(n for n in self.names() if n != "tp")

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def describe(self) -> str:
        """E.g. ``"dp_shard 128 x tp 8"``."""
        return " x ".join(f"{n} {getattr(self, n)}" for n in self.names())

    def to_dict(self) -> dict[str, int]:
        return {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "tp": self.tp}


def tp_dim(fqn: str) -> Optional[int]:
    """The dim the plan splits parameter ``fqn`` on, or None (replicated on TP). A column-parallel
    Linear's bias is split like its output (dim 0), a row-parallel one's is replicated; the
    embedding's weight ``[vocab, dim]`` is split on the vocabulary (``RowwiseParallel`` on an
    ``nn.Embedding``)."""
    parts = fqn.split(".")
    if len(parts) < 2 or parts[-1] not in ("weight", "bias"):
        return None
    module, kind = parts[-2], parts[-1]
    if module in COLWISE or (module == "embed_tokens" and kind == "weight"):
        return 0
    if module in ROWWISE and kind == "weight":
        return 1
    return None


def tp_plan(model: nn.Module) -> dict[str, object]:
    """``parallelize_module``'s plan for ``model``: module FQN -> Colwise/RowwiseParallel."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, object] = {}
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in COLWISE:
            plan[name] = ColwiseParallel()
        elif leaf in ROWWISE:
            plan[name] = RowwiseParallel()
    return plan


def local_shape(shape: tuple[int, ...], dim: Optional[int], tp: int, tp_rank: int) -> tuple[int, ...]:
    """Shape of TP rank ``tp_rank``'s piece, ``torch.chunk(t, tp, dim)[tp_rank]`` (0 where
    torch.chunk gives fewer pieces); the whole shape for ``dim=None``."""
    if dim is None or tp == 1:
        return tuple(shape)
    chunk = -(-shape[dim] // tp)
    start = min(tp_rank * chunk, shape[dim])
    length = min(start + chunk, shape[dim]) - start
    return tuple(shape[:dim]) + (length,) + tuple(shape[dim + 1 :])
