"""Benchmark results as data (tools/kit/results.py), bench_fsdp's markdown (tools/step_bench/
markdown.py) and tools/render_results.py, on a synthetic results file: no benchmark runs here."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tools import bench_fsdp, render_results
from tools.kit import results
from tools.step_bench.markdown import render
from tools.step_bench.methods import BenchConfig

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20


def _method(ms: float, peak_mib: float, gathers: int = 5, sent_mib: float = 10.0) -> dict:
    return {"median_ms": ms, "peak_bytes": peak_mib * MIB,
            "comm": {"collectives": {"all_gather": gathers, "reduce_scatter": 3}, "bytes_sent": sent_mib * MIB}}


def _timed_fields(mode: str) -> dict:
    res = {"steps": 6, "methods": {"ours": _method(750, 300), "row": _method(720, 290), "fsdp2": _method(1000, 300),
                                   "floor": _method(600, 400, gathers=0, sent_mib=0)},
           "ratios": {"cpu_ours_over_floor_plus_c10d": 1.04, "bound_step_ours_over_floor": 1.08}}
    res["methods"]["floor"]["comm"]["collectives"] = {}
    return dict(config=dict(vars(BenchConfig())), world=2, backend="gloo", threads_per_rank=1, model="Llama",
                data="text", result=res)


def _timed(mode: str) -> dict:
    return results.record(f"python3 tools/bench_fsdp.py --dtype {mode}", **_timed_fields(mode))


def _counts() -> dict:
    got = {"ours": {"collectives": {"all_gather": 7, "reduce_scatter": 4}},
           "row": {"collectives": {"all_gather": 7, "reduce_scatter": 4, "broadcast": 1}},
           "fsdp2": {"collectives": {"all_gather": 7, "reduce_scatter": 4}}}
    counts = {"world": 2, "config": dict(vars(BenchConfig())), "methods": ["ours", "row", "fsdp2"],
              "modes": {"fp32": {"head_root": got, "llama": got}}}
    return results.record("python3 tools/bench_fsdp.py --counts", counts=counts)


def _row(table: str, starts: str) -> list[str]:
    line = next(line for line in table.splitlines() if line.startswith(starts))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_save_keeps_the_latest_run_per_mode_and_the_host(tmp_path: Path) -> None:
    path = tmp_path / "r" / "bench_fsdp.json"
    results.save(path, "fp32", _timed("fp32"))
    results.save(path, "bf16", _timed("bf16"))
    newer = _timed("fp32")
    newer["result"]["steps"] = 9
    data = results.save(path, "fp32", newer)
    assert data == json.loads(path.read_text())
    assert sorted(data["runs"]) == ["bf16", "fp32"] and data["runs"]["fp32"]["result"]["steps"] == 9
    host = data["runs"]["bf16"]["host"]
    assert set(host["flags"]) == set(results.SPEED_FLAGS) and host["cores"] >= 1 and host["torch"]
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():  # the flags are this host's
        flags = set(next(line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")).split())
        assert host["flags"] == {f: f in flags for f in results.SPEED_FLAGS}
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a results file"):
        results.load(tmp_path / "bad.json")


def test_markdown_has_both_layouts_ratios_counts_and_provenance() -> None:
    runs = {"fp32": _timed("fp32"), "bf16": _timed("bf16"), "counts": _counts()}
    table = render({"tool": "bench_fsdp", "runs": runs})
    assert table.startswith(render_results.markdown.HEADER)
    chunk = _row(table, "| fp32 | ours, FSDP2's chunked")
    assert chunk[2:] == ["750", "0.75", "1.25", "300.0 (1.00)", "5 / 3", "10.0"]
    row = _row(table, "| fp32 | ours, flat row-atomic")
    assert row[2:5] == ["720", "0.72", "1.20"] and row[5] == "290.0 (0.97)"
    assert _row(table, "| bf16 | floor")[6:] == ["", ""]  # no communication to count
    assert table.index("| fp32 |") < table.index("| bf16 |")  # the modes in order, not as JSON sorts them
    assert "1 thread per rank); median of 6 timed steps" in table and "avx512_bf16" in table
    assert "`python3 tools/bench_fsdp.py --dtype bf16`" in table and "own share" in table and "1.04" in table
    counts = _row(table, "| fp32 | head_root")
    assert counts[2:] == ["7 / 7 / 7", "4 / 4 / 4", "11 / 12 / 11"]
    assert table.index("| fp32 | llama") < table.index("| fp32 | head_root")
    only_counts = render({"runs": {"counts": runs["counts"]}})
    assert "| mode | method |" not in only_counts and "head_root" in only_counts
    assert "No results yet" in render({"runs": {}})


def test_modes_of_one_run_state_their_setup_once() -> None:
    one_run = {m: results.record("python3 tools/bench_fsdp.py", **_timed_fields(m)) for m in ("fp32", "bf16")}
    one_run["bf16"]["date"] = one_run["fp32"]["date"]  # recorded a moment apart, in the same minute
    table = render({"runs": one_run})
    assert table.count("median of 6 timed steps") == 1
    assert "* bf16: the same model, run and host as fp32." in table
    assert table.count("own share") == 2  # each mode still states its own ratios
    one_run["bf16"]["config"]["dim"] += 1  # another setup: stated in full
    assert render({"runs": one_run}).count("median of 6 timed steps") == 2


def test_render_results_rewrites_only_between_the_markers_and_checks(tmp_path: Path, capsys) -> None:
    results_dir, readme = tmp_path / "results", tmp_path / "README.md"
    before, after = "# Title\n\ntext before\n", "\ntext after\n"
    readme.write_text(f"{before}{render_results.BEGIN}\n| typed | by hand |\n{render_results.END}\n{after}")
    args = ["--results-dir", str(results_dir), "--readme", str(readme)]
    assert render_results.main(args) == 0 and "no results" in capsys.readouterr().out  # nothing to render
    results.save(results_dir / "bench_fsdp.json", "fp32", _timed("fp32"))
    assert render_results.main(args + ["--check"]) == 1
    assert "README.md" in capsys.readouterr().out
    assert render_results.main(args) == 0
    text, table = readme.read_text(), (results_dir / "bench_fsdp.md").read_text()
    assert text == f"{before}{render_results.BEGIN}\n{table}{render_results.END}\n{after}"
    assert table == render(results.load(results_dir / "bench_fsdp.json"))
    assert render_results.main(args + ["--check"]) == 0
    assert render_results.main(args) == 0 and readme.read_text() == text  # idempotent
    results.save(results_dir / "bench_fsdp.json", "bf16", _timed("bf16"))  # a new run: stale again
    assert render_results.main(args + ["--check"]) == 1
    readme.write_text(before)  # no markers: said, nothing written
    assert render_results.main(args) == 2
    assert "bench-table:begin" in capsys.readouterr().err and readme.read_text() == before


def test_readme_table_is_the_one_the_committed_results_make() -> None:
    """README.md's benchmark table is rendered from tools/results/, never typed or left stale."""
    assert (ROOT / "tools" / "results" / "bench_fsdp.json").exists()
    assert render_results.main(["--check"]) == 0


def test_readme_has_one_pair_of_markers() -> None:
    marked = render_results.replace_block((ROOT / "README.md").read_text(), "TABLE\n")
    assert marked.count("TABLE") == 1


def test_only_the_default_model_saves_to_the_default_file(tmp_path: Path) -> None:
    def args(**kw):
        return argparse.Namespace(**{"results": None, "no_results": False, **kw})

    default = results.RESULTS_DIR / "bench_fsdp.json"
    assert bench_fsdp.results_path(BenchConfig(steps=2, dtypes=("bf16",)), args(), 2) == default
    assert bench_fsdp.results_path(BenchConfig(layers=2), args(), 2) is None  # a quick look
    assert bench_fsdp.results_path(BenchConfig(), args(), 4) is None
    assert bench_fsdp.results_path(BenchConfig(model="float8"), args(), 2) is None
    assert bench_fsdp.results_path(BenchConfig(layers=2), args(results=str(tmp_path / "x.json")), 2) == tmp_path / "x.json"
    assert bench_fsdp.results_path(BenchConfig(), args(no_results=True), 2) is None
    said = bench_fsdp.save_results(tmp_path / "x.json", {"fp32": _timed_fields("fp32")}, "cmd")
    assert "x.json" in said and (tmp_path / "x.md").read_text().count("| fp32 |") == 4
    assert "not saved" in bench_fsdp.save_results(None, {}, "cmd")
