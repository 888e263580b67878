"""A unit that runs on some ranks only hangs the others; the error must name it.

The scenario is the most common hang reported against FSDP2, torchtitan and Megatron-FSDP: a
multimodal model whose encoder runs only on ranks whose batch holds images. Rank 0 gathers the
encoder while rank 1 gathers the next unit. Each case runs on its own gloo process group with a
short timeout (the default one would wait 30 minutes), and is destroyed after:

* default mode: each rank's collective times out and fsdp raises ``dbuffer.CollectiveError``
  naming the unit, the collective, its call number and bytes, what the other rank was doing,
  and ``DBUFFER_DEBUG_COLLECTIVES=1``;
* debug mode: every rank raises ``CollectiveMismatchError`` at the encoder's gather, at once;
* torch FSDP2, same model: gloo's timeout, naming nothing of the model.

Gloo makes the receiving process abort (``terminate called ... Received data size doesn't match
expected size``) when two all-gathers of different sizes meet, so the cases are built to avoid
that: the default-mode case gathers an encoder under 2 MiB a shard (gloo's one-call all-gather)
while the blocks' shards are 2 MiB (dbuffer's point-to-point gather: the two never match, both
wait); the other cases give the encoder the blocks' size (the gathers pair up, silently, and the
ranks part later).
"""

from __future__ import annotations

import datetime
import re
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

import fsdp
from dbuffer import CollectiveError, calls, debug
from tests.harness import run_ranks

TIMEOUT = 5.0  # seconds: the process group's timeout in these cases


class Encoder(nn.Module):
    def __init__(self, width: int, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, dim)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.proj(images).mean(0)


class Multimodal(nn.Module):
    """An encoder for images, then blocks over the text; the encoder runs only with images."""

    def __init__(self, width: int, dim: int) -> None:
        super().__init__()
        self.encoder = Encoder(width, dim)
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(2))
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor, images=None) -> torch.Tensor:
        if images is not None:
            x = x + self.encoder(images)
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x).sum()


def _step_with_images_on_rank_0(impl: str, width: int, dim: int, debug_on: bool) -> tuple[str, str, float]:
    """One training step where only rank 0's batch has images, on a fresh group with a short
    timeout: (the error's class, its message, seconds from the step's start to the error)."""
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=TIMEOUT))
    was, was_timeout = debug.ENABLED, debug.TIMEOUT
    try:
        mesh = DeviceMesh.from_group(group, "cpu")
        torch.manual_seed(0)
        model = Multimodal(width, dim)
        if impl == "fsdp2":
            from torch.distributed.fsdp import fully_shard
        else:
            fully_shard = fsdp.fully_shard
        for unit in (model.encoder, *model.layers, model):
            fully_shard(unit, mesh=mesh)
        x = torch.randn(4, dim)
        images = torch.randn(3, width) if dist.get_rank() == 0 else None
        if debug_on:
            debug.set_enabled(True, timeout=TIMEOUT)
        start = time.monotonic()
        try:
            model(x, images).backward()
        except Exception as exc:
            return type(exc).__name__, str(exc), time.monotonic() - start
        return "no error", "", time.monotonic() - start
    finally:
        debug.set_enabled(was, timeout=was_timeout)
        dist.destroy_process_group(group)


def test_the_default_mode_names_the_skipped_unit_and_what_each_rank_waits_in() -> None:
    """Rank 0 waits in the encoder's all-gather, rank 1 in the first block's: both raise, each
    naming its own call and the other's, within the timeout plus the wait for the other's report."""
    results = run_ranks(_step_with_images_on_rank_0, 2, "fsdp", 512, 1024, False, backend="gloo", timeout=90)
    (kind0, message0, seconds0), (kind1, message1, seconds1) = results
    assert kind0 == kind1 == CollectiveError.__name__, results
    first = re.match(r"all_gather #(\d+) of fsdp unit 'encoder' \(\w+\), 1\.0 MiB in, 2\.0 MiB out on process group", message0)
    assert first, message0
    seq = first.group(1)  # fully_shard's checks and the root's gather came before: the same on both ranks
    assert message1.startswith(f"all_gather #{seq} of fsdp unit 'layers.0' (FSDPLinear), 2.0 MiB in, 4.0 MiB out"), message1
    assert f"rank(s) [1]: all_gather #{seq} of fsdp unit 'layers.0'" in message0, message0
    assert f"rank(s) [0]: all_gather #{seq} of fsdp unit 'encoder'" in message1, message1
    for message in (message0, message1):
        assert "Timed out waiting" in message and "DBUFFER_DEBUG_COLLECTIVES=1" in message, message
    for seconds in (seconds0, seconds1):
        assert TIMEOUT - 1 <= seconds <= TIMEOUT + calls.REPORT_WAIT + 5, results


def test_the_debug_mode_raises_at_the_skipped_units_gather_at_once() -> None:
    """Same-sized units (their gathers would pair up): the debug mode compares the units' labels
    too, so both ranks raise at the encoder's gather, long before the timeout."""
    results = run_ranks(_step_with_images_on_rank_0, 2, "fsdp", 8, 8, True, backend="gloo", timeout=90)
    for kind, message, seconds in results:
        assert kind == debug.CollectiveMismatchError.__name__, results
        assert re.search(r"rank\(s\) \[0\]: all_gather torch.float32 \[\d+, \d+\] of fsdp unit 'encoder'", message), message
        assert re.search(r"rank\(s\) \[1\]: all_gather torch.float32 \[\d+, \d+\] of fsdp unit 'layers.0'", message), message
        assert seconds < TIMEOUT, results
    assert results[0][1] == results[1][1]


def test_same_sized_units_pair_up_until_the_ranks_part_and_the_error_says_so() -> None:
    """Same-sized units: the skipped encoder's gathers pair with the next units' until the ranks
    part at the second block; each names it, and that the ranks are at different call numbers."""
    results = run_ranks(_step_with_images_on_rank_0, 2, "fsdp", 8, 8, False, backend="gloo", timeout=90)
    seqs = []
    for kind, message, seconds in results:
        assert kind == CollectiveError.__name__, results
        found = re.match(r"all_gather #(\d+) of fsdp unit '(layers\.\d)'", message)
        assert found, message
        seqs.append(int(found.group(1)))
        assert "The ranks are at different call numbers" in message, message
    assert seqs[0] != seqs[1], results


def test_fsdp2_in_the_same_case_times_out_naming_nothing() -> None:
    """The reference: torch FSDP2 on the same model (same-sized units) fails only at the
    timeout, with gloo's message: a rank's timeout, and on the other rank either its own timeout or,
    when the first rank's timeout closed their connection first, gloo's "Connection closed by peer"."""
    results = run_ranks(_step_with_images_on_rank_0, 2, "fsdp2", 8, 8, False, backend="gloo", timeout=90)
    assert any("Timed out waiting" in message for _, message, _ in results), results
    for kind, message, seconds in results:
        assert "Timed out waiting" in message or "Connection closed by peer" in message, results
        assert "encoder" not in message and "layers" not in message, results
        assert seconds >= TIMEOUT - 1, results
