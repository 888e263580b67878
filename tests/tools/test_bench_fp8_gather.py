"""tools/bench_fp8_gather.py: its core trains a tiny MLP stack four ways on 2 gloo ranks; the
bytes and casts it reports are checked against what they must be (no timing asserts)."""

from __future__ import annotations

import math

from tests.harness import run_ranks
from tools import bench_fp8_gather

TINY = dict(dim=32, layers=2, batch=4, micro=2, steps=2, warmup=1)


def test_bench_fp8_gather_on_a_tiny_model() -> None:
    reports = run_ranks(bench_fp8_gather.run_benchmark, 2, TINY, backend="gloo", timeout=120)
    report = reports[0]
    m = report["methods"]
    assert set(m) == set(bench_fp8_gather.METHODS)
    dim, layers, world = TINY["dim"], TINY["layers"], 2
    weights = 2 * layers
    for name, r in m.items():
        assert r["weights"] == weights and len(r["times_ms"]) == TINY["steps"] and r["median_ms"] > 0
    # bf16: each block's 2 x 4 d^2 elements, 2 bytes, gathered in forward and backward of each
    # micro-batch; each rank sends (W - 1) / W of it
    bf16 = layers * 8 * dim * dim * 2 * 2 * TINY["micro"] * (world - 1) / world
    assert m["ours bf16"]["gather_bytes_per_step"] == m["fsdp2 bf16"]["gather_bytes_per_step"] == bf16
    # fp8: 1 byte per element plus a 4-byte scale per row (up: 4d rows, down: d rows); ours
    # aligns each input to 16 bytes (at most 15 more per input)
    rows = layers * 5 * dim
    fp8 = (layers * 8 * dim * dim + 4 * rows) * 2 * TINY["micro"] * (world - 1) / world
    assert m["fsdp2 fp8"]["gather_bytes_per_step"] == fp8
    assert fp8 <= m["ours fp8"]["gather_bytes_per_step"] <= fp8 + 15 * 2 * weights * 2 * TINY["micro"]
    # casts: ours once per weight and step; FSDP2 at each gather (forward and backward, per micro-batch)
    assert m["ours fp8"]["casts_per_step"] == weights
    assert m["fsdp2 fp8"]["casts_per_step"] == weights * 2 * TINY["micro"]
    assert m["ours bf16"]["casts_per_step"] == m["fsdp2 bf16"]["casts_per_step"] == 0
    # same weights, same batch: the first losses agree between fsdp and FSDP2
    for kind in ("bf16", "fp8"):
        assert math.isclose(m[f"ours {kind}"]["losses"][0], m[f"fsdp2 {kind}"]["losses"][0], rel_tol=1e-2)
    assert "ours fp8/bf16 gather bytes" in bench_fp8_gather.format_report(report)
