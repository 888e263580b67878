"""tools/bench_compile.py: its core compiles a tiny Llama's layers under both libraries on 2 gloo
ranks and reports every field; checked for what must hold (no timing asserts)."""

from __future__ import annotations

from tests.harness import run_ranks
from tools import bench_compile

TINY = ["--layers", "2", "--dim", "16", "--heads", "2", "--hidden", "24", "--vocab", "32", "--seq", "8",
        "--batch", "2", "--steps", "1", "--backend", "eager"]


def test_bench_compile_core_on_a_tiny_model() -> None:
    args = bench_compile.parse_args(TINY)
    report = run_ranks(bench_compile.run_benchmark, 2, args, timeout=300)[0]
    assert set(report["methods"]) == {"ours", "fsdp2"}
    for name, m in report["methods"].items():
        assert m["first_s"] > 0 and len(m["steady_s"]) == 1 and m["frames"] >= 1, (name, m)
        assert len(m["losses"]) == 3, (name, m)
    assert report["methods"]["ours"]["graph_breaks"] == 0
    assert report["methods"]["fsdp2"]["graph_breaks"] == 0
    # the same model and batches under the same arithmetic: the losses agree to rounding
    assert report["max_loss_diff"] <= 1e-5, report["max_loss_diff"]
    assert report["ratios"]["first_step"] > 0 and report["ratios"]["steady_step"] > 0
    text = bench_compile.format_report(report)
    assert "ours / fsdp2: first step" in text and "graph breaks" in text
