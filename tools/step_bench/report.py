"""bench_fsdp's report: the table it prints and the bar chart it draws (``--plot``)."""

from __future__ import annotations

from typing import Optional

from tools.kit.timing import PHASES
from tools.step_bench.counts import split_kinds
from tools.step_bench.methods import METHODS, VARIANTS

MIB = 1 << 20


def _fmt(x: Optional[float], spec: str = ".2f", suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def format_table(report: dict) -> str:
    cfg = report["config"]
    lines = [
        f"Llama vocab {cfg['vocab']}, dim {cfg['dim']}, {cfg['layers']} layers, {cfg['heads']} heads, "
        f"hidden {cfg['hidden']}, seq {cfg['seq']}, batch {cfg['batch']}/rank; world {report['world']} "
        f"({report['backend']}, {report['threads_per_rank']} thread/rank), torch {report['torch']}",
        f"model: {report.get('model', 'Llama, fully_shard per block, then the root')}",
        f"ours: fsdp.fully_shard, sharding_strategy={cfg['strategy']}; "
        f"fsdp2: torch fully_shard on the same modules (its default ZeRO-3); floor: plain model, no communication",
        f"data: {report['data']}",
        f"time: {report['timing']}",
        f"memory: {report['memory_method']}",
        f"communication: {report['comm_method']}",
    ]
    for mode, res in report["modes"].items():
        lines.append("")
        lines.append(f"== {mode}: {res['steps']} timed steps per method after {res['warmup']} warmup + "
                     f"{res['measured_steps']} measured (untimed) ==")
        gemm = res.get("gemm_gflops")
        if gemm and mode in gemm:
            g, f = gemm[mode], gemm["fp32"]
            lines.append(f"  one-thread {mode} matmul here: {g['x@W.T']:.1f} GFLOP/s as x@W.T (forward), "
                         f"{g['g@W']:.1f} as g@W (backward)" + ("" if mode == "fp32" else
                         f"; fp32: {f['x@W.T']:.1f} / {f['g@W']:.1f}"))
        for name, text in res["policy"].items():
            lines.append(f"  {name:<6} {text}; {res['optimizer'][name]}")
        head = (f"  {'method':<7}{'median ms':>10}{'min ms':>9}{'max ms':>9}{'cpu ms':>9}{'peak MiB r0/r1':>18}"
                f"{'start MiB':>10}{'ops/step':>9}{'calls':>7}{'sent MiB':>10}{'loss@0':>9}{'loss@end':>9}")
        lines.append(head)
        lines.append("  " + "-" * (len(head) - 2))
        for name, m in res["methods"].items():
            peaks = m.get("peak_bytes_by_rank")
            peak_txt = "/".join(f"{b / MIB:.1f}" for b in peaks) if peaks else "-"
            start = max(m["start_bytes_by_rank"]) / MIB if peaks else None
            comm = m.get("comm")
            lines.append(
                f"  {name:<7}{_fmt(m['median_ms'], '.1f'):>10}{_fmt(m['min_ms'], '.1f'):>9}"
                f"{_fmt(m['max_ms'], '.1f'):>9}{_fmt(m.get('cpu_ms'), '.1f'):>9}{peak_txt:>18}{_fmt(start, '.1f'):>10}"
                f"{(comm['ops'] if comm else '-'):>9}{(comm['calls'] if comm else '-'):>7}"
                f"{_fmt(comm['bytes_sent'] / MIB if comm else None, '.1f'):>10}"
                + (f"{'-':>9}{'-':>9}" if name == "c10d" else f"{m['loss'][0]:>9.4f}{m['loss'][-1]:>9.4f}")
            )
        for name, m in res["methods"].items():
            comm = m.get("comm")
            if comm and comm["calls"]:
                kinds = ", ".join(f"{k} {v['calls']} x ({v['bytes_sent'] / MIB:.1f} MiB sent)"
                                  for k, v in sorted(comm["by_kind"].items()))
                lines.append(f"  {name} c10d calls per step: {kinds}")
        lines.extend(_collectives_lines(res["methods"]))
        lines.extend(phase_lines(res["methods"], res.get("fault_us")))
        r = res["ratios"]
        lines.append(
            f"  ratios: step ours/fsdp2 {_fmt(r['step_ours_over_fsdp2'])}, ours/floor "
            f"{_fmt(r['step_ours_over_floor'])}, fsdp2/floor {_fmt(r['step_fsdp2_over_floor'])}; peak memory "
            f"ours/fsdp2 {_fmt(r['peak_ours_over_fsdp2'])}, ours/floor {_fmt(r['peak_ours_over_floor'])}; "
            f"collective ops ours/fsdp2 {_fmt(r['ops_ours_over_fsdp2'])} (c10d calls "
            f"{_fmt(r['calls_ours_over_fsdp2'])}, bytes sent {_fmt(r['sent_ours_over_fsdp2'])})"
        )
        lines.extend(_layout_lines(res))
        for v in VARIANTS:
            if v != "row" and f"peak_{v}_over_fsdp2" in r:
                lines.append(
                    f"  variant {v} ({res['policy'][v]}; {res['optimizer'][v]}): peak memory {v}/fsdp2 "
                    f"{_fmt(r[f'peak_{v}_over_fsdp2'])}, {v}/ours {_fmt(r[f'peak_{v}_over_ours'])}; step {v}/fsdp2 "
                    f"{_fmt(r[f'step_{v}_over_fsdp2'])}"
                )
        if "bound_step_ours_over_floor" in r:
            lines.append(
                f"  raw c10d: the communication alone takes {_fmt(r['cpu_c10d_over_floor'])} of the floor's CPU time; "
                + (f"{res['busy_threads']} compute threads on {res['cores']} cores leave it no idle core, so no step "
                   f"can be below (floor + c10d CPU)/floor = {_fmt(r['bound_step_ours_over_floor'])} of the floor here"
                   if r["cores_saturated"] else
                   f"{res['cores']} cores for {res['busy_threads']} compute threads: it can hide, bound "
                   f"{_fmt(r['bound_step_ours_over_floor'])} of the floor")
                + (f"; ours' CPU time / (floor + c10d) {_fmt(r['cpu_ours_over_floor_plus_c10d'])} (the framework's own share)"
                   if "cpu_ours_over_floor_plus_c10d" in r else "")
                + (f"; FSDP2 took {_fmt(r.get('step_fsdp2_over_floor'))} of the floor, "
                   f"so ours/FSDP2 cannot be below {_fmt(r['bound_step_ours_over_fsdp2'])} in this run"
                   if "bound_step_ours_over_fsdp2" in r else "")
            )
        lines.append(
            f"  robustness: ours/fsdp2 paired per round {_fmt(r.get('paired_step_ours_over_fsdp2'))}, of minima "
            f"{_fmt(r['min_step_ours_over_fsdp2'])}, of CPU time {_fmt(r['cpu_ours_over_fsdp2'])}; ours/floor paired "
            f"{_fmt(r.get('paired_step_ours_over_floor'))}, of minima {_fmt(r['min_step_ours_over_floor'])}, of CPU "
            f"time {_fmt(r['cpu_ours_over_floor'])}"
        )
        for t in res["targets"]:
            verdict = "n/a" if t["value"] is None else ("MET" if t["met"] else "MISSED")
            bound = t.get("bound")
            below = (f" (unreachable in this run: with no framework cost at all, floor + raw c10d CPU "
                     f"would give {_fmt(bound)})" if bound is not None and bound > t["limit"] else "")
            lines.append(f"  target {t['what']} <= {t['limit']:.2f}: {_fmt(t['value'])} {verdict}{below}")
        lines.append(f"  ({res['wall_s']:.0f} s)")
    lines.append(f"\nwall time {report['wall_s']:.0f} s")
    return "\n".join(lines)


def _collectives_lines(methods: dict) -> list[str]:
    """The collectives each sharded method's step asks for, side by side (tools/kit/comm.py)."""
    counted = {n: split_kinds(m["comm"]["collectives"]) for n, m in methods.items()
               if m.get("comm") and m["comm"].get("collectives")}
    if not counted:
        return []
    head = f"  {'collectives per step':<22}" + "".join(f"{n:>8}" for n in counted)
    rows = [head]
    for kind, label in (("all_gather", "all-gather"), ("reduce_scatter", "reduce-scatter"),
                        ("all_reduce", "all-reduce"), ("other", "other"), ("all", "all")):
        rows.append(f"  {label:<22}" + "".join(f"{k[kind]:>8}" for k in counted.values()))
    return rows


def phase_lines(methods: dict, fault_us: Optional[float] = None) -> list[str]:
    """Where each method's step spends CPU time, by phase, and what ours adds to the floor: the
    account of the framework's own share (tools.kit.timing.cpu_mark says what is measured;
    ``fault_us``, tools.kit.timing.fault_probe, what a page fault costs on this host)."""
    shown = {n: m["phases"] for n, m in methods.items() if m.get("phases")}
    if not shown:
        return []
    cols = PHASES
    rows = ["  CPU ms per step by phase (median over steps, mean over ranks): the training thread's own time in "
            "forward, backward, optimizer (step + zero_grad); 'other' = the process's other threads (gloo's, "
            "where c10d works); faults = fresh 4 KiB pages touched (big buffers allocated anew every step)",
            f"    {'method':<8}" + "".join(f"{c:>11}" for c in cols) + f"{'other':>9}{'total':>9}{'faults':>9}"]
    for name, ph in shown.items():
        own, other, total, faults = _phase_totals(ph)
        rows.append(f"    {name:<8}" + "".join(f"{x:>11.1f}" for x in own) + f"{other:>9.1f}{total:>9.1f}{faults:>9.0f}")
    above = ours_above_floor(methods, fault_us)
    if above is not None:
        rows.append(f"    {'ours-floor':<8}" + "".join(f"{above[c]:>+11.1f}" for c in cols)
                    + f"{above['other']:>+9.1f}{above['total']:>+9.1f}{above['faults']:>+9.0f}")
        if "beyond_c10d" in above:
            rows.append("    " + above_text(above))
    return rows


def _phase_totals(ph: dict) -> tuple[list[float], float, float, float]:
    """``(own ms per phase, other threads ms, total ms, faults)`` of one method's phases; the c10d
    replay's one phase counts as other threads' time (the communication), whichever thread ran it."""
    own = [ph[c]["own_ms"] if c in ph else 0.0 for c in PHASES]
    if "communication" in ph:
        other = ph["communication"]["own_ms"] + ph["communication"]["other_ms"]
        return own, other, other, ph["communication"]["faults"]
    other = sum(p["other_ms"] for p in ph.values())
    return own, other, sum(own) + other, sum(p["faults"] for p in ph.values())


def ours_above_floor(methods: dict, fault_us: Optional[float] = None) -> Optional[dict]:
    """What ours' step costs beyond the floor's, in CPU ms per step: per phase on the training
    thread, on the other threads, in all, its extra page faults; with the c10d replay, how much
    is left beyond the communication itself (``beyond_c10d``: the framework's own work), and with
    ``fault_us`` what the extra faults cost."""
    ours, floor = (methods.get(n, {}).get("phases") for n in ("ours", "floor"))
    if not (ours and floor):
        return None
    o, f = _phase_totals(ours), _phase_totals(floor)
    out = dict(zip(PHASES, (a - b for a, b in zip(o[0], f[0]))))
    out.update(other=o[1] - f[1], total=o[2] - f[2], faults=o[3] - f[3])
    replay = methods.get("c10d", {}).get("phases")
    if replay:
        out["c10d"] = _phase_totals(replay)[2]
        out["beyond_c10d"] = out["total"] - out["c10d"]
    if fault_us:
        out["faults_ms"] = out["faults"] * fault_us / 1e3
        out["fault_us"] = fault_us
    return out


def above_text(above: dict) -> str:
    """One sentence: ours' CPU time beyond floor + raw c10d, by phase (README's notes, the table)."""
    text = (f"ours above floor + raw c10d: {above['beyond_c10d']:+.1f} ms of CPU per step, the framework's own work "
            f"(forward {above['forward']:+.1f}, backward {above['backward']:+.1f}, optimizer "
            f"{above['optimizer']:+.1f} on the training thread; gloo's threads {above['other'] - above['c10d']:+.1f} "
            f"beyond the {above['c10d']:.1f} ms the c10d replay takes): copies and casts in and out of the "
            f"collectives' buffers, the reductions' sums, Python, page faults")
    if "faults_ms" in above:
        text += (f"; its {above['faults']:.0f} more page faults cost about {above['faults_ms']:.1f} ms at "
                 f"{above['fault_us']:.2f} us each (measured here)")
    return text


def _layout_lines(res: dict) -> list[str]:
    """The default layout (ours: FSDP2's torch.chunk pieces) against the flat row-atomic one (row),
    measured in the same run: the choice of the default, with its evidence."""
    r, methods = res["ratios"], res["methods"]
    if "ours" not in methods or "row" not in methods:
        return []
    rows = ["  layouts, in the same run: chunk = ours (FSDP2's torch.chunk pieces, fully_shard's default), "
            "row = layout_policy('auto') (flat row-atomic, no copy-out / copy-in)",
            f"    {'layout':<8}{'step/FSDP2':>12}{'paired':>8}{'step/floor':>12}{'cpu/FSDP2':>11}{'peak/FSDP2':>12}"]
    for label, name in (("chunk", "ours"), ("row", "row")):
        rows.append(f"    {label:<8}{_fmt(r.get(f'step_{name}_over_fsdp2')):>12}"
                    f"{_fmt(r.get(f'paired_step_{name}_over_fsdp2')):>8}{_fmt(r.get(f'step_{name}_over_floor')):>12}"
                    f"{_fmt(r.get(f'cpu_{name}_over_fsdp2')):>11}{_fmt(r.get(f'peak_{name}_over_fsdp2')):>12}")
    rows.append(f"    row/chunk: step {_fmt(r.get('step_row_over_ours'))} (paired per round "
                f"{_fmt(r.get('paired_step_row_over_ours'))}), peak memory {_fmt(r.get('peak_row_over_ours'))}")
    return rows


# fsdp's own profiler ranges (fsdp/unit/state.py LABELS, fsdp/group/*): the unit's phases contain
# the group's collectives and copies, so the two kinds are listed apart, never summed together.
INNER_LABELS = ("fsdp::all_gather", "fsdp::copy_out", "fsdp::reduce_scatter", "fsdp::optimizer_refresh")


def fsdp_breakdown(events, steps: int, step_ms: Optional[float] = None) -> str:
    """Where ours' step goes by fsdp's own profiler labels: ``events`` are torch.profiler's
    ``key_averages()`` rows (``key``, ``count``, ``cpu_time_total`` in us); the labels of units below
    the root (``fsdp::pre_forward (blocks.0)``) are summed per phase. Per step: calls, CPU ms
    inside the range (inclusive), and its share of the step's time when ``step_ms`` is given."""
    totals: dict[str, list[float]] = {}
    for e in events:
        if not e.key.startswith("fsdp::"):
            continue
        label = e.key.split(" (", 1)[0]
        entry = totals.setdefault(label, [0, 0.0])
        entry[0] += e.count
        entry[1] += e.cpu_time_total / 1000.0
    if not totals:
        return "no fsdp:: ranges recorded (is this method fsdp's?)"
    lines = [f"{'fsdp range':<26}{'calls/step':>11}{'ms/step':>10}" + ("   share of step" if step_ms else "")]
    for title, inner in (("phases of a unit", False), ("inside them: collectives, copies, refresh", True)):
        lines.append(f"-- {title}")
        for label in sorted(totals, key=lambda k: -totals[k][1]):
            if (label in INNER_LABELS) != inner:
                continue
            calls, ms = totals[label][0] / steps, totals[label][1] / steps
            share = f"   {ms / step_ms:>6.1%}" if step_ms else ""
            lines.append(f"{label:<26}{calls:>11.1f}{ms:>10.2f}{share}")
    return "\n".join(lines)


def write_plot(report: dict, path: str) -> str:
    """Bar charts: median step time relative to the floor (absolute ms on the bars) and peak
    memory per rank, per mode and method."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"--plot: matplotlib is not installed, so no plot was written to {path} (pip install matplotlib)"
    modes = list(report["modes"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    shown = [m for m in METHODS if m != "c10d"]  # the replay trains nothing
    width = 0.8 / len(shown)
    for k, name in enumerate(shown):
        xs = [i + (k - (len(shown) - 1) / 2) * width for i in range(len(modes))]
        rel, labels, peaks = [], [], []
        for mode in modes:
            methods = report["modes"][mode]["methods"]
            ms = methods.get(name, {}).get("median_ms")
            floor = methods.get("floor", {}).get("median_ms")
            rel.append(ms / floor if ms and floor else 0)
            labels.append(f"{ms / 1e3:.1f}s" if ms else "")
            peaks.append((methods.get(name, {}).get("peak_bytes") or 0) / MIB)
        bars = axes[0].bar(xs, rel, width, label=name)
        axes[0].bar_label(bars, labels, fontsize=7)
        axes[1].bar(xs, peaks, width, label=name)
    axes[0].axhline(1.0, color="grey", linewidth=0.8)
    for ax, title in zip(axes, ("median step time / floor (seconds on bars)", "peak memory per rank (MiB)")):
        ax.set_xticks(range(len(modes)))
        ax.set_xticklabels(modes)
        ax.set_title(title)
        ax.legend()
    cfg = report["config"]
    fig.suptitle(f"Llama dim {cfg['dim']}, {cfg['layers']} layers, batch {cfg['batch']}/rank, world "
                 f"{report['world']} (gloo, CPU, torch {report['torch']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"plot written to {path}"
