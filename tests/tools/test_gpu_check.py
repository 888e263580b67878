"""tools/gpu_check.py: its ``--cpu`` run passes every row and saves them as data; the verdict
logic fails what it must (a broken comparison, NaN, a missing value, a row that checked nothing
or raised); a section process that dies or hangs is reported on the rows it left; the driver exits
1 on a failed row; the CUDA stream report classifies a trace's device events.

The CUDA paths of the tool itself (NCCL world 1, threaded ranks on cuda:0, the stream report of a
real trace) run only when a GPU is lent: ``python3 tools/gpu_check.py``."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tools import gpu_check
from tools.gpu_checks import common
from tools.gpu_checks.profiling import kernel_streams
from tools.gpu_checks.rows import FAIL, PASS, Check, Row, table

ROOT = Path(__file__).resolve().parents[2]


def _tool(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """The tool with one torch thread per process (its sections inherit it): the CPU sizes are
    tiny, and on a busy host OpenMP's spinning made steps take seconds; no check depends on it."""
    return subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_cpu_run_passes_every_row_and_saves_them(tmp_path: Path, capsys) -> None:
    saved = ROOT / "tools" / "results" / "gpu_check-cpu.json"
    before = saved.stat().st_mtime_ns if saved.exists() else None
    assert gpu_check.main(["--cpu", "--list"]) == 0  # the listing in this process: it imports nothing more
    listed = [line for line in capsys.readouterr().out.splitlines() if line]
    run = _tool("--cpu", "--out", str(tmp_path))
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-6000:]
    data = json.loads((tmp_path / "gpu_check-cpu.json").read_text())
    rec = data["runs"]["cpu"]
    rows = {f"{r['section']}/{r['name']}": r for r in rec["rows"]}
    assert list(rows) == listed  # every row ran, in order, once
    assert {s.split("/")[0] for s in listed} == set(gpu_check.SECTIONS)
    assert rec["passed"] and all(r["verdict"] == PASS for r in rows.values()), run.stdout
    assert all(r["checks"] and all(c["ok"] for c in r["checks"]) for r in rows.values())
    # the matrix compares with both references and world 1 really called c10d
    fp32 = {c["name"]: c for c in rows["matrix/fp32"]["checks"]}
    assert {"vs plain", "vs FSDP2", "grad norms vs plain", "c10d calls/step", "losses fell"} <= set(fp32)
    assert fp32["c10d calls/step"]["value"] > 0
    assert rows["multirank/w4 hsdp 2x2"]["losses"]["fsdp"][1] < rows["multirank/w4 hsdp 2x2"]["losses"]["fsdp"][0]
    methods = {"ours", "row", "fsdp2", "flat", "flat_bf16_state", "floor"}
    assert rows["bench/world 1 fp32"]["figures"]["step ms"].keys() == methods
    assert all(v > 0 for v in rows["bench/world 1 fp32"]["figures"]["optimizer GB/s"].values())
    assert "fsdp::all_gather" in rows["profile/fsdp:: ranges"]["figures"]["fsdp:: ranges"]
    text = (tmp_path / "gpu_check-cpu.txt").read_text()
    for name in listed:
        assert name in run.stdout and name in text
    assert f"all {len(listed)} rows PASS" in run.stdout and "torch " + torch.__version__ in run.stdout
    assert (saved.stat().st_mtime_ns if saved.exists() else None) == before  # --out: nothing in the repo


def test_checks_fail_on_broken_missing_or_non_finite_values() -> None:
    assert Check("x", 1e-7, 1e-6).ok and not Check("x", 2e-6, 1e-6).ok
    assert not Check("x", math.nan, 1e-6).ok and not Check("x", math.inf, 1e-6).ok
    assert not Check("x", None, 1e-6).ok and not Check("x", 0.0, None).ok
    assert Check("fell", 4.6, 5.6, op="<").ok and not Check("fell", 5.6, 5.6, op="<").ok
    assert Check("ran", True, True, op="==").ok and not Check("ran", False, True, op="==").ok
    assert not Check("ran", True, True, op="<=").ok  # a yes/no fact only compares with ==
    with pytest.raises(ValueError, match="op must be"):
        Check("x", 1, 2, op="~")
    row = Row("s", "r")
    assert row.verdict == FAIL and row.problems() == ["no check ran"]  # nothing checked is no pass
    row.check("vs plain", 0.0, 1e-5, metric="max|dW|")
    assert row.verdict == PASS
    row.check("losses fell", 2, 3, op="==")
    assert row.verdict == FAIL and "losses fell: 2 == 3 FAILED" in row.problems()
    raised = Row("s", "r2")
    raised.check("vs plain", 0.0, 1e-5)
    try:
        raise RuntimeError("first line\nKeyError: the last line says what")
    except RuntimeError as exc:
        raised.fail_with(exc)
    assert raised.verdict == FAIL and raised.error.startswith("RuntimeError: first line")
    assert "Traceback" in raised.traceback
    back = Row.from_dict(json.loads(json.dumps(raised.to_dict())))
    assert back.verdict == FAIL and back.error == raised.error and back.checks == raised.checks
    lines = table([row, raised])
    assert "FAIL" in lines[2] and "ERROR RuntimeError" in lines[3]


def _trained(state: dict, norms: list) -> common.Trained:
    return common.Trained(state, [5.0, 4.0], norms)


def test_a_broken_comparison_is_reported_as_a_failure() -> None:
    """compare() on trained weights: equal passes; one weight off, a wrong gradient scale (which
    Adam hides from the weights) or a badly updated tensor in mixed precision each fail."""
    setup = common.Setup("cpu")
    g = torch.Generator().manual_seed(0)
    start = {"a": torch.randn(50, 4, generator=g), "b": torch.randn(7, generator=g)}
    ref = {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in start.items()}
    good = _trained({k: v.clone() for k, v in ref.items()}, [1.0, 2.0])

    def verdict(got: common.Trained, precision: str = "fp32") -> Row:
        row = Row("t", precision)
        common.compare(row, setup, precision, got, _trained(ref, [1.0, 2.0]), _trained(ref, [1.0, 2.0]), start)
        return row

    assert verdict(good).verdict == PASS
    off = {k: v.clone() for k, v in ref.items()}
    off["a"][3, 1] += 1e-3
    row = verdict(_trained(off, [1.0, 2.0]))
    assert row.verdict == FAIL and row.figures["over 1e-06 vs FSDP2"] == "1 of 207", row.figures
    assert verdict(_trained(ref, [1.001, 2.002])).verdict == FAIL  # gradients scaled by 1.001
    assert verdict(_trained(ref, [1.0])).verdict == FAIL  # a step's norm missing
    assert verdict(good, "bf16").verdict == PASS
    wrong_tensor = {"a": ref["a"], "b": start["b"] - (ref["b"] - start["b"])}  # b's update reversed
    row = verdict(_trained(wrong_tensor, [1.0, 2.0]), "bf16")
    assert row.verdict == FAIL and any(c.metric == "rel dW" and not c.ok for c in row.checks), row.checks


def test_losses_must_fall() -> None:
    row = Row("t", "r")
    common.loss_checks(row, {"plain": [5.5, 4.6], "fsdp": [5.5, 5.7]})
    assert row.verdict == FAIL and row.losses == {"plain": [5.5, 4.6], "fsdp": [5.5, 5.7]}


def test_rows_a_dead_or_killed_section_left_are_reported() -> None:
    finished = Row("matrix", "fp32")
    finished.check("vs plain", 0.0, 1e-5)
    entries = [{"started": "matrix/fp32"}, {"row": finished.to_dict()}, {"started": "matrix/bf16"}]
    rows = gpu_check._collect("matrix", ["fp32", "bf16", "muon owned"], entries,
                              "the section process died with SIGSEGV")
    assert [(r.name, r.verdict) for r in rows] == [("fp32", PASS), ("bf16", FAIL), ("muon owned", FAIL)]
    assert rows[1].error == "the section process died with SIGSEGV during this row"
    assert rows[2].error == "not run: the section process died with SIGSEGV"
    # every row done, but the process ended badly afterwards (an abort at exit): its own row
    rows = gpu_check._collect("bench", ["fp32"], [{"started": "bench/fp32"}, {"row": finished.to_dict() | {"section": "bench", "name": "fp32"}}],
                              "the section process exited with code 134")
    assert [(r.name, r.verdict) for r in rows] == [("fp32", PASS), ("(process)", FAIL)]
    # an error outside any row (the process group did not start) is every row's
    rows = gpu_check._collect("profile", ["fsdp:: ranges"], [{"section_error": {"error": "RuntimeError: no NCCL",
                                                                               "traceback": "tb"}}], None)
    assert rows[0].verdict == FAIL and "RuntimeError: no NCCL" in rows[0].error and rows[0].traceback == "tb"


def test_a_section_past_the_time_limit_is_killed_and_reported(tmp_path: Path) -> None:
    run = _tool("--cpu", "--only", "matrix/fp32", "--timeout", "1", "--out", str(tmp_path), timeout=120)
    assert run.returncode == 1, run.stdout
    rows = json.loads((tmp_path / "gpu_check-cpu.json").read_text())["runs"]["cpu"]["rows"]
    assert [(r["name"], r["verdict"]) for r in rows] == [("fp32", FAIL), ("fp32 layout auto", FAIL)]
    assert "killed after 1 s" in rows[0]["error"]


def test_the_driver_exits_1_when_a_row_fails(tmp_path: Path, monkeypatch) -> None:
    failing = Row("matrix", "fp32")
    failing.check("vs plain", 1.0, 1e-5)
    monkeypatch.setattr(gpu_check, "_section_process", lambda name, *a: [failing] if name == "matrix" else [])
    assert gpu_check.main(["--cpu", "--out", str(tmp_path)]) == 1
    rec = json.loads((tmp_path / "gpu_check-cpu.json").read_text())["runs"]["cpu"]
    assert rec["passed"] is False and rec["rows"][0]["verdict"] == FAIL


def test_stream_report_classifies_a_traces_device_events() -> None:
    """A synthetic chrome trace: an all-gather's memcpy (a group of one) launched inside the
    c10d op counts as collective work on the NCCL stream; kernels and copies elsewhere by name."""
    trace = {"traceEvents": [
        {"ph": "X", "cat": "cpu_op", "name": "c10d::_allgather_base_", "tid": 1, "ts": 100, "dur": 50},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "tid": 1, "ts": 120, "dur": 2,
         "args": {"correlation": 7}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "tid": 1, "ts": 300, "dur": 2,
         "args": {"correlation": 8}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "args": {"stream": 21, "correlation": 7}},
        {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_f32f32", "args": {"stream": 7, "correlation": 8}},
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", "args": {"stream": 21}},
        {"ph": "X", "cat": "kernel", "name": "void at::native::elementwise_kernel<copy_kernel>", "args": {"stream": 13}},
        {"ph": "X", "cat": "gpu_memset", "name": "Memset (Device)", "args": {"stream": 7}},
    ]}
    assert kernel_streams(trace) == {"comm": {"21": 2}, "copy": {"13": 1, "7": 1}, "compute": {"7": 1}}
    assert kernel_streams({}) == {"comm": {}, "copy": {}, "compute": {}}


def test_only_selects_by_pattern_or_substring() -> None:
    assert common.selected("matrix/bf16 layout auto", [])
    assert common.selected("matrix/bf16 layout auto", ["matrix/bf16"])
    assert common.selected("multirank/w4 hsdp 2x2", ["*hsdp*"])
    assert not common.selected("matrix/fp32", ["multirank", "bench"])
