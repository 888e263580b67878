"""A steady step runs its gathers and reductions prepared: nothing is validated or planned again.

``Unsharder._all_gather`` (buffers its weights part keeps), ``GradReducer``'s direct
reduction into ``main_grad`` and a unit's shared gather hold a :class:`dbuffer.PreparedSlot`:
after the first step no ``DBuffer.redistribute`` or ``prepare_redistribute`` runs. Something
that replaces the buffers (``module.to(dtype)``) makes the next step prepare again (the slot
compares identities: it never moves the old buffers), then none; the values are compared with
one process by the conversion tests (``test_api``), here the counts and the storage.
"""

from __future__ import annotations

import pytest
import torch

import fsdp
from dbuffer import DBuffer
from tests.fsdp.models import loss_fn, make_batches, make_model
from tests.harness import run_ranks


class _Count:
    """Wraps DBuffer's redistribute and prepare_redistribute, counting the calls."""

    def __init__(self) -> None:
        self.calls = {"redistribute": 0, "prepare_redistribute": 0}

    def __enter__(self) -> "_Count":
        self._originals = {name: getattr(DBuffer, name) for name in self.calls}
        for name, original in self._originals.items():
            def counted(buf, *args, _name=name, _original=original, **kwargs):
                self.calls[_name] += 1
                return _original(buf, *args, **kwargs)
            setattr(DBuffer, name, counted)
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._originals.items():
            setattr(DBuffer, name, original)


def _moves_per_step(model, batches, policy) -> dict:
    for block in model.blocks:
        fsdp.fully_shard(block, mp_policy=policy)
    fsdp.fully_shard(model, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(batch) -> None:
        loss_fn(model, *batch).backward()
        opt.step()
        opt.zero_grad()

    step(batches[0])  # the first step prepares
    counts = []
    storages = []
    for batch in batches[1:3]:
        with _Count() as c:
            step(batch)
        counts.append(c.calls)
        group = model.blocks[0]._fsdp_state.groups[0]
        storages.append(group.unsharder._gathers._op.out.local_buffer.untyped_storage().data_ptr())
    model.to(torch.float64)  # new buffers: prepared again once, the old ones never moved
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for batch in batches[3:5]:
        with _Count() as c:
            step(batch)  # token ids: the same batches
        counts.append(c.calls)
    return {"counts": counts, "storages": storages}


@pytest.mark.parametrize("policy", [fsdp.MixedPrecisionPolicy(), fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)],
                         ids=["fp32", "bf16 compute"])
def test_steady_steps_validate_and_plan_nothing(policy) -> None:
    out = run_ranks(_moves_per_step, 4, make_model(blocks=2), make_batches(5), policy, backend="fake")[0]
    nothing = {"redistribute": 0, "prepare_redistribute": 0}
    assert out["counts"][0] == out["counts"][1] == nothing, out["counts"]
    assert out["storages"][0] == out["storages"][1], "a steady gather lands in the same storage"
    after_to = out["counts"][2]
    assert after_to["prepare_redistribute"] > 0, "module.to built new buffers: the step must prepare again"
    assert out["counts"][3] == nothing, out["counts"]
