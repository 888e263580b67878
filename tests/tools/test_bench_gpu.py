"""tools/bench_gpu.py, run on CPU (gloo, world 1, then a fake world 8) on a tiny Llama: the tables
it prints for a lent GPU hold every method, the three sharded methods of the same arithmetic train
the same model to the same loss, sharding over eight fake ranks shrinks every sharded method's
peak, and the optimizer's bytes are the count of what it must move."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--dim", "64", "--layers", "2", "--heads", "4", "--vocab", "512", "--seq", "32", "--batch", "2",
        "--steps", "2", "--warmup", "1"]


def _rows(text: str) -> dict[tuple[str, str], list[str]]:
    """(mode, method) -> the cells of its table row."""
    rows, mode = {}, None
    for line in text.splitlines():
        if line.startswith("== "):
            mode = line[3:].strip()
        elif line.startswith("| ") and not line.startswith("| method") and not line.startswith("| ---"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[(mode, cells[0])] = cells[1:]
    return rows


def _params() -> int:
    from tests.models.llama import Llama, LlamaConfig

    cfg = LlamaConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, hidden_dim=11 * 64 // 4, max_seq_len=32)
    return sum(p.numel() for p in Llama(cfg).parameters())


def test_bench_gpu_runs_on_cpu_and_reports_both_worlds() -> None:
    # one torch thread: on a model this small a second one only adds waits (and on a busy host
    # OpenMP's spinning makes each step seconds); none of the promises depends on it
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_gpu.py"), *TINY, "--micro", "2"], cwd=ROOT,
                         capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    rows = _rows(run.stdout)
    methods = ("ours", "row", "fsdp2", "flat", "flat_bf16_state", "floor")
    assert set(rows) == {(m, n) for m in ("fp32", "bf16") for n in methods}, run.stdout
    assert "in 2 micro-batch(es)" in run.stdout
    n = _params()
    # The optimizer's floor of bytes (world 1: every parameter): FP32 weights and AdamW's two
    # states read and written, the gradient read in its dtype (flat's BF16 main grads: 2 B);
    # the bf16 floor holds everything in bf16; BF16 moments are 2 B each.
    moved = {("fp32", m): 28 for m in methods} | {("bf16", m): 28 for m in ("ours", "row", "fsdp2")}
    moved |= {("bf16", "flat"): 26, ("bf16", "floor"): 14, ("fp32", "flat_bf16_state"): 20, ("bf16", "flat_bf16_state"): 18}
    for (mode, name), per_param in moved.items():
        assert float(rows[(mode, name)][6]) == pytest.approx(per_param * n / 1e6, abs=0.051), (mode, name)
        assert float(rows[(mode, name)][5]) > 0 and float(rows[(mode, name)][7]) > 0
    for mode in ("fp32", "bf16"):
        losses = {n: float(rows[(mode, n)][-1]) for n in ("ours", "row", "fsdp2")}
        assert max(losses.values()) - min(losses.values()) < 1e-3, (mode, losses)
        for name in ("flat", "flat_bf16_state"):
            assert abs(float(rows[(mode, name)][-1]) - losses["fsdp2"]) < 1e-2, (mode, name)
        for name in ("ours", "row", "fsdp2", "flat", "flat_bf16_state"):
            world1 = float(re.match(r"([\d.]+)", rows[(mode, name)][3]).group(1))
            world8 = float(re.match(r"([\d.]+)", rows[(mode, name)][4]).group(1))
            assert 0 < world8 < world1, (mode, name, world1, world8)
        assert rows[(mode, "floor")][4] == ""  # the floor does not shard: no fake-world column
    assert run.stdout.count("(Megatron-FSDP reports 0.80)") == 8
