"""No host-device synchronisation inside a training step.

On a GPU a synchronising call (``tensor.item()``, ``bool(tensor)``, ``nonzero``, an event's
``synchronize``) stalls the host until the device catches up, and the step's host overhead can
no longer hide behind the kernels (``torch.cuda.set_sync_debug_mode("error")`` catches them
there; ``tools/gpu_check.py`` runs it). On the CPU the same calls are counted through two seams:
a dispatch mode that sees every aten op which needs the value of a device tensor on the host,
and the comm streams' device module, whose events record each host wait. A steady ZeRO-3 step
(bf16 compute, micro-batches, both layouts, offload without pinned memory) makes none of either.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import fsdp
from fsdp.group import streams as streams_module
from tests.fsdp.models import loss_fn, make_batches, make_model
from tests.fsdp.test_parity import shard
from tests.harness import run_ranks
from tests.models.device_standins import SyncCounter

class _CountingEvent:
    waits = records = 0

    def record(self, stream=None) -> None:
        _CountingEvent.records += 1

    def synchronize(self) -> None:
        _CountingEvent.waits += 1

    def query(self) -> bool:
        return True


def _steady_steps(model, batches, kwargs: dict) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    m = shard(copy.deepcopy(model), True, **kwargs)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    per = batches[0][0].shape[0] // world

    def step(x, y):
        x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        for xm, ym in zip(x.chunk(2), y.chunk(2)):
            (loss_fn(m, xm, ym) / 2).backward()
        opt.step()
        opt.zero_grad()

    step(*batches[0])  # lazy initialisation and the first allocations may look at values
    counter = SyncCounter()
    with counter:
        for x, y in batches[1:]:
            step(x, y)
    return counter.calls


def test_a_steady_step_makes_no_syncing_call() -> None:
    model, batches = make_model(), make_batches(3)
    cases = {
        "zero3 bf16": dict(mp_policy=fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)),
        "zero2": dict(sharding_strategy="optim_grads"),
        "offload": dict(offload_policy=fsdp.CPUOffloadPolicy(pin_memory=False)),
    }
    for name, kwargs in cases.items():
        for calls in run_ranks(_steady_steps, 2, model, batches, kwargs, backend="threaded"):
            assert calls == {}, (name, calls)


def test_the_counter_sees_a_syncing_call() -> None:
    counter = SyncCounter()
    with counter:
        float(torch.ones(2).sum())
        torch.ones(3).nonzero()
    assert sorted(k.split(" at ")[0] for k in counter.calls) == ["aten._local_scalar_dense.default", "aten.nonzero.default"]


def test_a_step_never_waits_for_an_event_on_the_host(monkeypatch) -> None:
    cpu = torch.cpu

    class Module:  # the CPU's stand-in streams, with events that count host waits
        Stream, current_stream, stream = cpu.Stream, cpu.current_stream, cpu.stream

        @staticmethod
        def Event():  # noqa: N802 (torch's name)
            return _CountingEvent()

    # Set here, around all the ranks (threads of this process), and undone by monkeypatch.
    monkeypatch.setattr(streams_module, "_device_module", lambda device: Module)
    monkeypatch.setattr(streams_module, "_CACHE", {})
    _CountingEvent.waits = _CountingEvent.records = 0
    run_ranks(_steady_steps, 2, make_model(), make_batches(3), {}, backend="threaded")
    assert _CountingEvent.records > 0 and _CountingEvent.waits == 0, (_CountingEvent.records, _CountingEvent.waits)
