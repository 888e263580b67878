"""fully_shard on ranks whose models differ: every rank raises the same clear error naming the
first differing parameter and the ranks (torch FSDP2 aborts or silently mixes the inits)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp
from dbuffer.agreement import RankMismatchError
from tests.harness import run_ranks


def _shard(case: str) -> str:
    rank = dist.get_rank()
    torch.manual_seed(rank if case == "seed" else 0)
    last = 3 + rank if case == "shape" else 3
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, last))
    kwargs = {"reshard_after_forward": rank == 0} if case == "argument" else {}
    try:
        fsdp.fully_shard(model, **kwargs)
    except RankMismatchError as exc:
        assert not isinstance(model, fsdp.FSDPModule)  # nothing was changed
        return str(exc)
    model(torch.randn(2, 4)).sum().backward()
    return "trained"


def test_a_layer_of_another_size_is_named_on_every_rank() -> None:
    messages = run_ranks(_shard, 2, "shape", backend="gloo")
    assert messages[0] == messages[1]
    assert "'1.weight'" in messages[0] and "(3, 8)" in messages[0] and "(4, 8)" in messages[0], messages[0]


def test_different_seeds_are_an_error_not_a_silent_mixture() -> None:
    messages = run_ranks(_shard, 2, "seed", backend="gloo")
    assert messages[0] == messages[1]
    assert "'0.weight values'" in messages[0] and "same code and seed" in messages[0], messages[0]


def test_different_arguments_are_named() -> None:
    messages = run_ranks(_shard, 2, "argument", backend="gloo")
    assert "fully_shard arguments" in messages[0], messages[0]


def test_same_models_train() -> None:
    assert run_ranks(_shard, 2, "same", backend="gloo") == ["trained", "trained"]
