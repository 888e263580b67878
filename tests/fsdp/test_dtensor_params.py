"""Sharded parameters are exact DTensors: user code (EMA, weight decay masks, norms for logging,
copies of weights) gets the single-process values from any op on them."""

from __future__ import annotations

import torch
import torch.nn as nn

from dbuffer import RowShardedDTensor
from fsdp import fully_shard
from fsdp.group.layout_choice import layout_policy
from tests.harness import run_ranks

_OPS = {
    "p * 2": lambda p: p * 2,
    "zeros_like": torch.zeros_like,
    "detach().clone()": lambda p: p.detach().clone(),
    "sum": lambda p: p.sum(),
    "mean": lambda p: p.mean(),
    "norm": lambda p: p.norm(),
    "ema": lambda p: p.detach().clone().lerp_(p * 3, 0.1),
}


def _ops_on_params(ref: nn.Module, layout: str) -> int:
    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 7), nn.Linear(7, 2))
    model.load_state_dict(ref.state_dict())
    with layout_policy(layout):
        fully_shard(model)
    ragged = 0
    with torch.no_grad():
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            ragged += isinstance(p, RowShardedDTensor)
            for op_name, op in _OPS.items():
                got = op(p)
                got = got.full_tensor() if hasattr(got, "full_tensor") else got
                torch.testing.assert_close(got, op(q), msg=lambda m: f"{name} {op_name}: {m}")
            assert torch.equal(p.full_tensor(), q)
    return ragged


def test_ops_on_sharded_parameters_match_single_process() -> None:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 7), nn.Linear(7, 2))
    for backend in ("threaded", "gloo"):
        # Megatron's row-atomic layout: the case the issue reported, most of these are row-sharded
        ragged = run_ranks(_ops_on_params, 2, ref, "row", backend=backend)
        assert ragged[0] >= 3
        # FSDP2's default torch.chunk pieces: plain DTensors, no subclass
        assert run_ranks(_ops_on_params, 2, ref, "chunk", backend=backend) == [0, 0]
