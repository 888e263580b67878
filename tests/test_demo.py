"""The README's demo (tools/demo.py): a Llama trained with fsdp.fully_shard on 2 gloo ranks.

Three launches of a tiny configuration, shared by the tests: an uninterrupted run of N + M steps,
and a run of N steps whose checkpoint a third run resumes for M more. Resuming must reproduce
the uninterrupted run bit for bit: the batches depend only on the global step, and fp32 on gloo
with a fixed world size is deterministic.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

ROOT = Path(__file__).resolve().parent.parent
N, M = 12, 12
TINY = ["--size", "tiny", "--world", "2"]


def _launch(out: Path, name: str, *args: str) -> tuple[subprocess.Popen, Path]:
    """Start the demo; its process and the file it logs the per-step global losses to."""
    log = out / f"{name}.json"
    run = subprocess.Popen([sys.executable, str(ROOT / "tools" / "demo.py"), *TINY, "--loss-log", str(log), *args],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    return run, log


def _finished(launched: tuple[subprocess.Popen, Path]) -> dict:
    """Wait for a demo; its stdout and its per-step global losses."""
    run, log = launched
    try:
        stdout, stderr = run.communicate(timeout=240)
    finally:
        run.kill()  # a no-op once it has exited
    assert run.returncode == 0, stdout + stderr
    # a clean exit: no rank aborted in teardown, nothing left for the resource tracker to reap
    for trouble in ("terminate called", "leaked semaphore"):
        assert trouble not in stderr, stderr
    return {"stdout": stdout, **json.loads(log.read_text())}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The uninterrupted run and the first part of the interrupted one are independent (their own
    checkpoint directories): they run at once, most of each being interpreter start-up."""
    out = tmp_path_factory.mktemp("demo")
    whole = _launch(out, "whole", "--steps", str(N + M), "--checkpoint", str(out / "whole"))
    first = _launch(out, "first", "--steps", str(N), "--checkpoint", str(out / "resumed"))
    whole, first = _finished(whole), _finished(first)
    second = _finished(_launch(out, "second", "--steps", str(M), "--checkpoint", str(out / "resumed"), "--resume"))
    return {"out": out, "whole": whole, "first": first, "second": second}


def test_loss_falls_and_the_printed_losses_are_the_logged_ones(runs: dict) -> None:
    whole = runs["whole"]
    losses = whole["losses"]
    assert whole["start"] == 0 and len(losses) == N + M
    assert 5.3 < losses[0] < 6.0, losses  # random weights: about ln 256 = 5.545
    assert max(losses[-4:]) < losses[0] - 1.5, losses  # bytes of Python source are far from uniform
    first = float(re.search(r"^first loss +([0-9.]+) +\(step 0", whole["stdout"], re.M).group(1))
    last = float(re.search(rf"^last loss +([0-9.]+) +\(step {N + M - 1}\)", whole["stdout"], re.M).group(1))
    assert (first, last) == (round(losses[0], 4), round(losses[-1], 4)), whole["stdout"]


def test_resume_reproduces_the_uninterrupted_run_bitwise(runs: dict) -> None:
    first, second, whole = runs["first"], runs["second"], runs["whole"]
    assert "resumed from" in second["stdout"] and second["start"] == N, second["stdout"]
    assert first["losses"] == whole["losses"][:N]  # same start: a sanity check of determinism
    assert second["losses"] == whole["losses"][N:], (second["losses"], whole["losses"][N:])
    # The whole saved state (weights, AdamW moments and step, step counter) matches too.
    saved = {}
    for name in ("whole", "resumed"):
        dcp_to_torch_save(runs["out"] / name, runs["out"] / f"{name}.pt")
        saved[name] = torch.load(runs["out"] / f"{name}.pt", weights_only=False)
    assert saved["whole"]["step"] == saved["resumed"]["step"] == N + M
    assert _differences(saved["whole"], saved["resumed"]) == []
    assert len(saved["whole"]["optim"]["state"]) == len(saved["whole"]["model"]) > 0


def test_summary_has_a_line_per_rank_with_real_figures(runs: dict) -> None:
    stdout = runs["whole"]["stdout"]
    total = int(re.search(r"\): ([0-9,]+) parameters", stdout).group(1).replace(",", ""))
    rows = re.findall(r"^ +(\d+) +cpu +([0-9,]+) +([0-9.]+) MiB +([0-9.]+) MiB +([0-9.]+) MiB +(\d+) \((\d+) c10d",
                      stdout, re.M)
    assert [int(r[0]) for r in rows] == [0, 1], stdout
    held = [int(r[1].replace(",", "")) for r in rows]
    assert sum(held) == total and min(held) > 0, stdout  # ZeRO-3: the ranks split the parameters
    for _, _, peak, between, sent, ops, calls in rows:
        assert float(peak) > float(between) > 3 * 4 * total / 2 / 2**20  # its rows of weights + AdamW moments
        # ZeRO-3 all-gathers each rank's rows and reduce-scatters the gradients: at least 2x its half.
        assert float(sent) >= 2 * 4 * total / 2 / 2**20 * 0.99
        assert int(ops) > 0 and int(calls) >= int(ops)
    assert re.search(rf"checkpoint of step {N + M} saved to ", stdout), stdout


def _differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Paths where two nested dicts of tensors and plain values differ (tensors: bitwise)."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{path}: keys {sorted(a.keys() ^ b.keys())} differ"]
        return [d for k in a for d in _differences(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        same = a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1).view(torch.uint8),
                                                                          b.view(-1).view(torch.uint8))
        return [] if same else [path]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]
