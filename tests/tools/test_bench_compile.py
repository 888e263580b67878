"""tools/bench_compile.py: its core compiles a tiny Llama's layers under each library on 2 gloo
ranks and the summary reports every field; checked for what must hold (no timing asserts)."""

from __future__ import annotations

from tests.harness import run_ranks
from tools import bench_compile

TINY = ["--layers", "2", "--dim", "16", "--heads", "2", "--hidden", "24", "--vocab", "32", "--seq", "8",
        "--batch", "2", "--steps", "1", "--backend", "eager"]


def test_bench_compile_core_on_a_tiny_model() -> None:
    args = bench_compile.parse_args(TINY)
    pair = {name: run_ranks(bench_compile.run_method, 2, args, name, timeout=300)[0] for name in bench_compile.METHODS}
    for name, m in pair.items():
        assert m["first_s"] > 0 and len(m["steady_s"]) == 1 and m["frames"] >= 1, (name, m)
        assert len(m["losses"]) == 3, (name, m)
        assert m["graph_breaks"] == 0 and m["recompiles"] == 0, (name, m)
        assert m["first_cpu_s"] > 0 and m["compiled"]["graphs"] >= 1 and m["compiled"]["ops_captured"] > 0, (name, m)
    report = bench_compile.summarize([pair, pair], "eager", 2)
    # the same model and batches under the same arithmetic: the losses agree to rounding
    assert report["max_loss_diff"] <= 1e-5, report["max_loss_diff"]
    assert report["repeats"] == 2 and len(report["first_ratios"]) == 2
    assert report["ratios"]["first_step_max"] >= report["ratios"]["first_step_median"] > 0
    text = bench_compile.format_report(report)
    assert "ours / fsdp2: first step median" in text and "recompiles" in text and "CPU time" in text
