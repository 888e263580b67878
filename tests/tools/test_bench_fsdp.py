"""tools/bench_fsdp.py: its core (tools/step_bench/) trains one tiny Llama three ways on 2 gloo
ranks and reports every field; the numbers it reports are checked against what they must be (no
timing asserts)."""

from __future__ import annotations

from tests.harness import run_ranks
from tests.models.llama import LlamaConfig
from tools import bench_fsdp
from tools.step_bench.methods import BenchConfig, check_config
from tools.step_bench.report import format_table, ours_above_floor
from tools.step_bench.run import c10d_bound, run_benchmark

# Small enough to run in seconds; the vocabulary is large enough that the root unit's shard
# (embedding + lm_head, 4 MiB of fp32 per rank) takes dbuffer's point-to-point path on gloo,
# while the blocks' shards take the one-call collectives.
TINY = dict(dtypes=("fp32",), vocab=8192, dim=128, layers=2, heads=4, hidden=256, seq=32, batch=2,
            steps=2, warmup=1, methods=("ours", "row", "fsdp2", "floor", "c10d"))
METHOD_FIELDS = {"times_ms", "median_ms", "mean_ms", "min_ms", "max_ms", "loss", "loss_by_rank",
                 "start_bytes_by_rank", "peak_bytes_by_rank", "peak_bytes", "comm", "comm_by_rank"}


def test_bench_core_on_a_tiny_model() -> None:
    reports = run_ranks(run_benchmark, 2, TINY, backend="gloo", timeout=90)
    report = reports[0]
    assert {"config", "world", "torch", "data", "timing", "memory_method", "comm_method", "modes"} <= set(report)
    assert report["world"] == 2 and list(report["modes"]) == ["fp32"]
    res = report["modes"]["fp32"]
    assert {"policy", "optimizer", "methods", "ratios", "targets", "steps", "warmup"} <= set(res)
    assert set(res["methods"]) == {"ours", "row", "fsdp2", "floor", "c10d"}
    # Every rank reports the same, gathered results.
    assert reports[1]["modes"]["fp32"]["methods"]["ours"]["loss"] == res["methods"]["ours"]["loss"]
    total_steps = TINY["warmup"] + 1 + TINY["steps"]
    for name, m in res["methods"].items():
        assert METHOD_FIELDS <= set(m), (name, METHOD_FIELDS - set(m))
        assert len(m["times_ms"]) == TINY["steps"] and all(t > 0 for t in m["times_ms"])
        assert m["min_ms"] <= m["median_ms"] <= m["max_ms"]
        assert len(m["loss"]) == total_steps and len(m["peak_bytes_by_rank"]) == 2
        assert all(p >= s > 0 for p, s in zip(m["peak_bytes_by_rank"], m["start_bytes_by_rank"]))

    ours, row, fsdp2, floor = (res["methods"][k] for k in ("ours", "row", "fsdp2", "floor"))
    # Step 0: the same weights on the same batch give the same loss, whatever the method.
    for rank in range(2):
        l0 = floor["loss_by_rank"][rank][0]
        assert abs(ours["loss_by_rank"][rank][0] - l0) <= 1e-6 * abs(l0)
        assert abs(fsdp2["loss_by_rank"][rank][0] - l0) <= 1e-6 * abs(l0)
    # Both sharded methods train on the global batch: the same trajectory in fp32.
    assert all(abs(a - b) <= 1e-4 for a, b in zip(ours["loss"], fsdp2["loss"])), (ours["loss"], fsdp2["loss"])
    assert all(abs(a - b) <= 1e-4 for a, b in zip(row["loss"], fsdp2["loss"])), (row["loss"], fsdp2["loss"])
    # The floor trains each rank on its own half of the batch only: it leaves that trajectory.
    assert abs(floor["loss"][-1] - ours["loss"][-1]) > 1e-4

    # Memory: parameters + AdamW's two states are resident before the step (4 bytes each in fp32),
    # whole on every floor rank and split across the ranks of the sharded methods.
    numel = LlamaConfig(vocab_size=TINY["vocab"], dim=TINY["dim"], n_layers=TINY["layers"], n_heads=TINY["heads"],
                        hidden_dim=TINY["hidden"], max_seq_len=TINY["seq"]).num_parameters()
    assert min(floor["start_bytes_by_rank"]) >= 3 * 4 * numel
    for m in (ours, row, fsdp2):
        assert sum(m["start_bytes_by_rank"]) >= 3 * 4 * numel
        assert max(m["start_bytes_by_rank"]) < 3 * 4 * numel  # sharded: no rank holds it all

    # Communication: none for the floor; the same ZeRO-3 schedule for both libraries (3 units:
    # 3 all-gathers in forward, 2 again in backward, 3 reduce-scatters), and about the same bytes.
    assert floor["comm"]["calls"] == floor["comm"]["ops"] == 0 and floor["comm"]["bytes_sent"] == 0
    for m in (ours, fsdp2):
        assert m["comm"]["ops"] > 0 and m["comm"]["calls"] >= m["comm"]["ops"] and m["comm"]["bytes_sent"] > 0
    assert ours["comm"]["ops"] == fsdp2["comm"]["ops"] == 8
    assert ours["comm"]["calls"] > ours["comm"]["ops"]  # the root's isend/irecv pairs count as one op each
    # What the step asks for, however c10d carries it: ours' point-to-point gathers of the root
    # and its all-to-all reduce-scatters count as the all-gathers and reduce-scatters they are,
    # every one a call of dbuffer.collectives; FSDP2's c10d calls are their own kinds.
    for m in (ours, row, fsdp2):
        assert m["comm"]["collectives"] == {"all_gather": 5, "reduce_scatter": 3}, m["comm"]
    assert all(c["library_ops"] == 8 for c in ours["comm_by_rank"] + row["comm_by_rank"])
    assert all(c["library_ops"] == 0 for c in fsdp2["comm_by_rank"])
    assert "p2p_send" in ours["comm"]["by_kind"] and "all_to_all" in ours["comm"]["by_kind"]
    assert abs(ours["comm"]["bytes_sent"] / fsdp2["comm"]["bytes_sent"] - 1) < 0.05
    # Bandwidth-optimal bytes sent per rank: half of every gathered and every reduced unit.
    sent = 4 * (numel + (numel - 2 * TINY["vocab"] * TINY["dim"] - TINY["dim"]) + numel) / 2
    assert abs(fsdp2["comm"]["bytes_sent"] / sent - 1) < 0.05

    # The raw-c10d replay makes exactly ours' calls: the same kinds, counts and bytes, per rank.
    c10d = res["methods"]["c10d"]
    calls = lambda comm: [{k: c[k] for k in ("calls", "ops", "bytes_sent", "by_kind")} for c in comm]  # noqa: E731
    assert calls(c10d["comm_by_rank"]) == calls(ours["comm_by_rank"])
    assert all(loss == 0 for loss in c10d["loss"])

    ratios = res["ratios"]
    assert abs(ratios["step_ours_over_fsdp2"] - ours["median_ms"] / fsdp2["median_ms"]) < 1e-9
    assert ratios["cores_saturated"] == (res["busy_threads"] >= res["cores"])
    if ratios["cores_saturated"]:
        bound = (floor["cpu_ms"] + c10d["cpu_ms"]) / floor["cpu_ms"]
    else:
        bound = max(floor["median_ms"], c10d["median_ms"]) / floor["median_ms"]
    assert abs(ratios["bound_step_ours_over_floor"] - bound) < 1e-9 and bound >= 1
    # The same least step against this run's FSDP2, and the step target reports it as its bound.
    assert abs(ratios["bound_step_ours_over_fsdp2"] - bound * floor["median_ms"] / fsdp2["median_ms"]) < 1e-9
    step_target = next(t for t in res["targets"] if t["name"] == "step_ours_over_fsdp2")
    assert step_target["bound"] == ratios["bound_step_ours_over_fsdp2"]

    # Both layouts, against FSDP2, the floor and each other, from the same run's medians.
    for name, m in (("ours", ours), ("row", row)):
        assert abs(ratios[f"step_{name}_over_floor"] - m["median_ms"] / floor["median_ms"]) < 1e-9
        assert abs(ratios[f"peak_{name}_over_fsdp2"] - m["peak_bytes"] / fsdp2["peak_bytes"]) < 1e-9
    assert abs(ratios["step_row_over_ours"] - row["median_ms"] / ours["median_ms"]) < 1e-9
    assert "paired_step_row_over_ours" in ratios and ratios["all_gathers_ours_over_fsdp2"] == 1.0

    assert {t["name"] for t in res["targets"]} >= {"step_ours_over_fsdp2", "peak_ours_over_fsdp2",
                                                   "all_gathers_ours_over_fsdp2", "reduce_scatters_ours_over_fsdp2"}
    table = format_table(report)
    assert "ours" in table and "fsdp2" in table and "floor" in table and "target" in table
    assert "raw c10d: the communication alone takes" in table
    layouts = table.split("layouts, in the same run", 1)[1].splitlines()
    chunk_row = next(line for line in layouts if line.split()[:1] == ["chunk"])
    assert chunk_row.split()[1] == f"{ratios['step_ours_over_fsdp2']:.2f}"
    assert chunk_row.split()[3] == f"{ratios['step_ours_over_floor']:.2f}"
    assert any(line.split()[:1] == ["row"] for line in layouts)
    gathers = next(line for line in table.splitlines() if line.strip().startswith("all-gather "))
    assert gathers.split()[1:4] == ["5", "5", "5"]  # ours, row, fsdp2 side by side

    # Where the CPU time goes: the phases of a step add up to the step's CPU time (taken apart, by
    # process_time around the whole step); the floor runs no collective, so its other threads idle.
    for name, m in res["methods"].items():
        phases = m["phases"]
        assert set(phases) == ({"communication"} if name == "c10d" else {"forward", "backward", "optimizer"}), name
        assert all(p["own_ms"] >= 0 and p["faults"] >= 0 for p in phases.values())
        total = sum(p["own_ms"] + p["other_ms"] for p in phases.values())
        assert 0.5 * m["cpu_ms"] <= total <= 1.5 * m["cpu_ms"], (name, total, m["cpu_ms"])
    floor_phases = floor["phases"].values()
    assert sum(p["other_ms"] for p in floor_phases) < 0.2 * sum(p["own_ms"] for p in floor_phases)
    above = ours_above_floor(res["methods"], res["fault_us"])
    spent = lambda ph: sum(p["own_ms"] + p["other_ms"] for p in ph.values())  # noqa: E731
    assert abs(above["total"] - (spent(ours["phases"]) - spent(floor["phases"]))) < 1e-9
    assert abs(above["beyond_c10d"] - (above["total"] - spent(c10d["phases"]))) < 1e-9
    assert res["fault_us"] >= 0 and abs(above["faults_ms"] - above["faults"] * res["fault_us"] / 1e3) < 1e-9
    assert "CPU ms per step by phase" in table and "ours above floor + raw c10d" in table


def test_c10d_bound_counts_communication_cpu_only_when_no_core_is_idle() -> None:
    methods = {"floor": {"cpu_ms": 500.0, "median_ms": 520.0}, "c10d": {"cpu_ms": 60.0, "median_ms": 90.0},
               "ours": {"cpu_ms": 616.0, "median_ms": 650.0}, "fsdp2": {"cpu_ms": 700.0, "median_ms": 800.0}}
    full = c10d_bound({"methods": methods, "cores": 2, "busy_threads": 2})
    assert full["cores_saturated"] and abs(full["bound_step_ours_over_floor"] - 560 / 500) < 1e-12
    # Ours at the floor plus the communication, against this FSDP2: 560/500 * 520 ms over 800 ms.
    assert abs(full["bound_step_ours_over_fsdp2"] - 560 / 500 * 520 / 800) < 1e-12
    assert abs(full["cpu_ours_over_floor_plus_c10d"] - 616 / 560) < 1e-12
    spare = c10d_bound({"methods": methods, "cores": 16, "busy_threads": 2})
    assert not spare["cores_saturated"] and spare["bound_step_ours_over_floor"] == 1.0  # it can hide
    assert c10d_bound({"methods": {"floor": methods["floor"]}, "cores": 2, "busy_threads": 2}) == {}


def test_c10d_method_needs_ours_first_and_an_untimed_step() -> None:
    for methods, kw in ((("c10d", "ours"), {}), (("floor", "c10d"), {}), (("ours", "c10d"), dict(warmup=0, measure=False))):
        try:
            check_config(BenchConfig(methods=methods, **kw))
        except ValueError as exc:
            assert "'c10d'" in str(exc)
        else:
            raise AssertionError(f"{methods} {kw} was accepted")
    check_config(BenchConfig(methods=("ours", "c10d"), warmup=0))  # the measured step
    try:  # nothing to profile: the replay trains no model
        bench_fsdp.parse_args(["--profile", "c10d"])
    except SystemExit as exc:
        assert exc.code == 2
    else:
        raise AssertionError("--profile c10d was accepted")


def test_flat_and_lean_variants_run_and_report() -> None:
    """The variants train the same (the flat step is torch's AdamW per element) and, since every
    gather of these packed layouts casts the main shard into its own row, neither keeps a BF16
    shard: persistent_param_shard changes nothing here, which the tracker sees in equal peaks.
    (The flat variant's BF16 main grads save 2 bytes per element at the step; whether its
    backward peak is lower depends on the model: the FP32 reduce-scatter output of the group in
    flight is a temporary there, which fp32 main grads do not need.)"""
    cfg = dict(TINY, dtypes=("bf16",), vocab=512, steps=1, methods=("ours", "flat", "lean"))
    report = run_ranks(run_benchmark, 2, cfg, backend="gloo", timeout=120)[0]
    res = report["modes"]["bf16"]
    peaks = {name: m["peak_bytes"] for name, m in res["methods"].items()}
    assert peaks["lean"] == peaks["flat"], peaks
    assert res["optimizer"]["flat"].startswith("FlatAdamW")
    assert res["methods"]["flat"]["loss"] == res["methods"]["lean"]["loss"]
    table = format_table(report)
    assert "variant flat" in table and "variant lean" in table


def _profile_ours(cfg: dict) -> str:
    from tools.step_bench.run import profile_method

    return profile_method("ours", "fp32", BenchConfig(**cfg), steps=1, top=5)


def test_profile_prints_where_ours_spends_its_step_by_fsdp_range() -> None:
    text = run_ranks(_profile_ours, 2, TINY, backend="gloo", timeout=90)[0]
    section = text.split("== fsdp's own ranges", 1)[1].split("== cProfile", 1)[0]
    for label in ("fsdp::pre_forward", "fsdp::post_backward", "fsdp::all_gather", "fsdp::copy_out", "fsdp::reduce_scatter"):
        assert label in section, (label, section)
    assert "(blocks." not in section  # units below the root are summed into their phase


def test_breakdown_sums_units_per_phase_and_keeps_inner_ranges_apart() -> None:
    from types import SimpleNamespace as Row

    from tools.step_bench.report import fsdp_breakdown

    rows = [Row(key="fsdp::pre_forward", count=2, cpu_time_total=3000.0),
            Row(key="fsdp::pre_forward (blocks.0)", count=2, cpu_time_total=1000.0),
            Row(key="fsdp::all_gather", count=6, cpu_time_total=2000.0),
            Row(key="aten::mm", count=99, cpu_time_total=9e6)]
    text = fsdp_breakdown(rows, steps=2, step_ms=10.0)
    phase = next(line for line in text.splitlines() if line.startswith("fsdp::pre_forward"))
    assert phase.split()[1:] == ["2.0", "2.00", "20.0%"]  # (2 + 2) calls and (3 + 1) ms over 2 steps
    lines = text.splitlines()
    assert lines.index(next(l for l in lines if l.startswith("fsdp::all_gather"))) > lines.index(
        next(l for l in lines if l.startswith("-- inside")))
    assert "aten::mm" not in text and fsdp_breakdown(rows[3:], steps=1).startswith("no fsdp:: ranges")


def test_float8_model_leaves_out_the_flat_optimizer_variants() -> None:
    """fsdp.FlatAdamW does not take tensor-subclass weights: a float8 run names the methods to
    use instead of failing inside the optimizer, and its default leaves them out."""
    from tools.step_bench.methods import default_methods

    assert "flat" in default_methods("llama") and "flat" not in default_methods("float8")
    check_config(BenchConfig(model="float8", methods=default_methods("float8")))
    try:
        check_config(BenchConfig(model="float8", methods=("ours", "lean")))
    except ValueError as exc:
        assert "['lean']" in str(exc) and "--methods ours,row" in str(exc)
    else:
        raise AssertionError("lean on the float8 model was accepted")
    cfg, _ = bench_fsdp.parse_args(["--model", "float8"])
    assert cfg.methods == default_methods("float8")
