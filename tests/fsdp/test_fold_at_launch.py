"""A reduction into a sharded temporary (here: a micro-batch accumulating into ``main_grad``) is
folded into ``main_grad`` inside its launch when waiting for it blocks no host
(:meth:`~fsdp.group.streams.CommStreams.wait_is_free`: real streams order the wait, as FSDP2
accumulates on its side stream; on the CPU a collective already done), so that the temporary is
freed at once instead of living through the next unit's backward; otherwise it is folded at the
next unit's first gradient. Both branches run here (the seam forced each way) and give one
process's gradients on the global batch."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.distributed as dist

import fsdp
from fsdp.group.grads import GradReducer, Reduction
from fsdp.group.streams import CommStreams
from tests.fsdp.models import loss_fn, make_batches, make_model
from tests.harness import run_ranks

WORLD = 2


def _halves(x: torch.Tensor, y: torch.Tensor, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's two micro-batches: the halves of its share of the global batch."""
    per = x.shape[0] // WORLD
    xs, ys = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
    return [(xs[: per // 2], ys[: per // 2]), (xs[per // 2:], ys[per // 2:])]


def _two_synced_micro_batches(model, x, y) -> dict:
    """Both micro-batches reduce (the second accumulates into ``main_grad``); the gradients."""
    m = copy.deepcopy(model)
    for block in m.blocks:
        fsdp.fully_shard(block)
    fsdp.fully_shard(m)
    for xs, ys in _halves(x, y, dist.get_rank()):
        loss_fn(m, xs, ys).backward()
    return {n: p.grad.full_tensor() for n, p in m.named_parameters()}


@pytest.mark.parametrize("free", [True, False], ids=["wait-free", "host-would-block"])
def test_an_accumulating_reduction_folds_at_launch_when_waiting_is_free(monkeypatch, free: bool) -> None:
    model, ((x, y),) = make_model(), make_batches(1)
    ref = copy.deepcopy(model)
    for j in range(2):  # micro-batch j of every rank, as one global batch
        parts = [_halves(x, y, r)[j] for r in range(WORLD)]
        loss_fn(ref, torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])).backward()

    launched: list[tuple[Reduction, bool, bool]] = []  # (kind, folded, temporary alive after the launch)
    lock = threading.Lock()
    launch = GradReducer.launch_reduce

    def watched(self: GradReducer) -> None:
        launch(self)
        flight = self._in_flight
        if flight is not None and flight.kind is Reduction.ACCUMULATE:
            temporary = flight.pending.wait() if flight.folded else None
            with lock:
                launched.append((flight.kind, flight.folded, temporary is not None and not temporary.is_storage_released()))

    on_side_stream: list[bool] = []  # per accumulating fold: inside the reduce-scatter launch?
    fold = GradReducer._fold

    def watched_fold(self: GradReducer, result, kind: Reduction) -> None:
        if kind is Reduction.ACCUMULATE:  # the first micro-batch's reductions overwrite, in place
            # this thread's open launches (CPU stand-in streams are one process-wide state, which
            # threaded ranks share; the launch frames are per thread)
            with lock:
                on_side_stream.append(bool(self.parts.streams._frames()))
        fold(self, result, kind)

    monkeypatch.setattr(GradReducer, "launch_reduce", watched)
    monkeypatch.setattr(GradReducer, "_fold", watched_fold)
    monkeypatch.setattr(CommStreams, "wait_is_free", lambda self, pending: free)
    for grads in run_ranks(_two_synced_micro_batches, WORLD, model, x, y, backend="threaded"):
        for n, p in ref.named_parameters():
            assert torch.allclose(grads[n], p.grad, atol=1e-6, rtol=1e-5), n
    units = 1 + len(model.blocks)
    assert len(launched) == WORLD * units, launched  # the second micro-batch of every unit on every rank
    assert all(folded is free for _, folded, _ in launched), launched
    assert not any(alive for _, _, alive in launched), launched  # a folded temporary is freed at once
    # At its launch the fold runs on the reduce-scatter stream, ordered after the collective
    # (on a GPU the compute stream has not waited yet); later, on the compute stream after the wait.
    assert len(on_side_stream) == WORLD * units and all(s is free for s in on_side_stream), on_side_stream


class _Handle:
    def __init__(self, completed: bool) -> None:
        self.completed = completed

    def is_completed(self) -> bool:
        return self.completed


def test_waiting_is_free_on_real_streams_or_for_a_finished_collective() -> None:
    cpu = CommStreams(torch.device("cpu"))
    assert not cpu.enabled
    assert not cpu.wait_is_free(_Handle(False)) and cpu.wait_is_free(_Handle(True))
    cpu.enabled = True  # real streams: a wait only orders the current stream
    assert cpu.wait_is_free(_Handle(False))
