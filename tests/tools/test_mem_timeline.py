"""tools/mem_timeline.py: the phase peaks and their categories are what the step holds."""

from __future__ import annotations

import torch

from tools import mem_timeline
from tools.step_bench.methods import BenchConfig, Method

MIB = 1 << 20


def test_local_peaks_are_the_maxima_between_drops() -> None:
    rows = [(b * MIB, "fwd", f"op{i}", "here") for i, b in enumerate([1, 5, 3, 9, 9, 2, 4, 4, 1])]
    peaks = mem_timeline.local_peaks(rows, 3)
    assert [(event, nbytes // MIB) for event, nbytes, *_ in peaks] == [(4, 9), (2, 5), (7, 4)]


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(64, 256)
        self.b = torch.nn.Linear(256, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def test_optimizer_phase_holds_weights_grads_and_state_by_category() -> None:
    torch.manual_seed(0)
    method = Method("floor", _Tiny(), BenchConfig(foreach=False))
    method.loss_fn = lambda logits, tokens: logits.float().pow(2).mean()
    method.step(torch.randn(4, 65))  # the optimizer state exists from now on
    tracker = mem_timeline.TimelineTracker(mem_timeline.classifier(method))
    tracker.track(list(method.model.parameters()), method.opt.state)
    with tracker:
        mem_timeline.phased_step(method, torch.randn(4, 65), tracker)
    param_bytes = sum(p.numel() * 4 for p in method.model.parameters())
    optim = tracker.phase_peaks["optim"]["live"]
    assert optim["main"] == param_bytes
    assert optim["main grads"] == param_bytes
    assert optim["optimizer state"] == 2 * param_bytes
    assert set(tracker.phase_peaks) >= {"fwd", "bwd", "optim"}
    assert tracker.peak == max(p["bytes"] for p in tracker.phase_peaks.values())


def test_fake_world_with_micro_batches_names_every_phase_and_ours_buffers() -> None:
    """The command line on a fake world with gradient accumulation: each micro-batch's forward
    and backward is its own phase, and ours' own buffers are named (unsharded weights, main grads,
    the sharded main weights) at the second backward, where the first one's gradients are alive."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    run = subprocess.run(
        [sys.executable, str(root / "tools" / "mem_timeline.py"), "--fake-world", "4", "--dtype", "bf16",
         "--methods", "ours,flat,fsdp2", "--micro", "2", "--batch", "2", "--layers", "1", "--dim", "32",
         "--heads", "2", "--hidden", "64", "--vocab", "128", "--seq", "16", "--top", "40"],
        cwd=root, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "world 4 (fake: memory only), batch 2 in 2 micro-batch(es)" in run.stdout
    reports = run.stdout.split("== bf16 ")[1:]
    assert [r.split(":")[0] for r in reports] == ["ours", "flat", "fsdp2"]
    for report in reports:
        phases = [line.split(" max ")[0].strip() for line in report.splitlines() if " max " in line]
        assert phases == ["before step", "fwd 1", "bwd 1", "fwd 2", "bwd 2", "optim", "zero_grad"], phases
    second_backward = reports[0].split("bwd 2 ")[1].split("  optim ")[0]
    for label in ("unsharded", "main grads", "main", "optimizer state"):
        assert any(line.split(None, 1)[1] == label for line in second_backward.splitlines()[1:] if line.strip()), label
