"""tools/bench_gpu.py, run on CPU (gloo, world 1, then a fake world 8) on a tiny Llama: the tables
it prints for a lent GPU hold every method, the three sharded methods train the same model to
the same loss, and sharding over eight fake ranks shrinks every sharded method's peak."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

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


def test_bench_gpu_runs_on_cpu_and_reports_both_worlds() -> None:
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_gpu.py"), *TINY], cwd=ROOT,
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = _rows(run.stdout)
    assert set(rows) == {(m, n) for m in ("fp32", "bf16") for n in ("ours", "row", "fsdp2", "floor")}, run.stdout
    for mode in ("fp32", "bf16"):
        losses = {n: float(rows[(mode, n)][-1]) for n in ("ours", "row", "fsdp2")}
        assert max(losses.values()) - min(losses.values()) < 1e-3, (mode, losses)
        for name in ("ours", "row", "fsdp2"):
            world1 = float(re.match(r"([\d.]+)", rows[(mode, name)][3]).group(1))
            world8 = float(re.match(r"([\d.]+)", rows[(mode, name)][4]).group(1))
            assert 0 < world8 < world1, (mode, name, world1, world8)
        assert rows[(mode, "floor")][4] == ""  # the floor does not shard: no fake-world column
    assert run.stdout.count("(Megatron-FSDP reports 0.80)") == 4
