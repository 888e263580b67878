"""tools/bench_offload.py on CPU (rank 0 of a fake world of 8) on a tiny Llama: every choice gets a
row, and the device peaks it prints are what each choice moves off the device: offloading the
optimizer state saves exactly its bytes (AdamW's two FP32 states of this rank's shard), for
either step and either optimizer, and offloading everything saves more."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.models.llama import Llama, LlamaConfig

ROOT = Path(__file__).resolve().parents[2]
TINY = dict(dim=64, layers=1, heads=4, vocab=256, seq=16, batch=2)
WORLD = 8


def _rows(text: str) -> dict[str, list[str]]:
    rows = {}
    for line in text.splitlines():
        if line.startswith("| ") and not line.startswith("| method") and not line.startswith("| ---"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0]] = cells[1:]
    return rows


def _state_mib() -> float:
    """AdamW's exp_avg and exp_avg_sq of rank 0's torch.chunk pieces, in MiB."""
    cfg = LlamaConfig(vocab_size=TINY["vocab"], dim=TINY["dim"], n_layers=TINY["layers"], n_heads=TINY["heads"],
                      hidden_dim=3 * TINY["dim"], max_seq_len=TINY["seq"])
    numel = sum(torch.chunk(p.detach(), WORLD, 0)[0].numel() for p in Llama(cfg).parameters())
    return 2 * 4 * numel / 2**20


@pytest.mark.parametrize("optim", ["flat", "torch"])
def test_bench_offload_prints_every_choice_and_the_bytes_each_moves(optim: str) -> None:
    flags = [x for k, v in TINY.items() for x in (f"--{k}", str(v))]
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_offload.py"), *flags, "--world", str(WORLD),
                          "--steps", "1", "--warmup", "1", "--optim", optim],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = _rows(run.stdout)
    assert list(rows) == ["no_offload", "state_device", "state_host", "everything", "fsdp2_cpu_offload"], run.stdout
    peak = {name: float(cells[2]) for name, cells in rows.items()}
    assert all(float(cells[1]) > 0 for cells in rows.values()), run.stdout  # step times
    saved = _state_mib()
    for name in ("state_device", "state_host"):
        assert abs(peak["no_offload"] - peak[name] - saved) < 2e-3, (name, peak, saved, run.stdout)
    assert peak["everything"] < peak["state_host"], run.stdout
    assert peak["fsdp2_cpu_offload"] < peak["no_offload"], run.stdout
    assert "ours / FSDP2's CPUOffloadPolicy: step time" in run.stdout
