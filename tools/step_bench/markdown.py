"""bench_fsdp's results as markdown: the table README.md shows and ``tools/results/bench_fsdp.md``
holds, made from ``tools/results/bench_fsdp.json`` (:mod:`tools.kit.results`) by
``tools/render_results.py`` and by the benchmark itself after each run.

One table of the timed modes (``fp32``, ``bf16``: a row per method, ratios against FSDP2 and the
floor, peak memory, the collectives a step asks for, bytes sent), each mode's provenance under
it (model, steps, date, host, command; once for modes of the same run), and one table of the
collective counts (``--counts``: per model, ours on both layouts against FSDP2).
"""

from __future__ import annotations

from typing import Optional

from tools.kit.results import describe_host
from tools.step_bench.counts import split_kinds
from tools.step_bench.methods import MODELS
from tools.step_bench.report import above_text, ours_above_floor

MIB = 1 << 20
TIMED_MODES = ("fp32", "bf16")
LABELS = {
    "ours": "ours, FSDP2's chunked layout (default)",
    "row": "ours, flat row-atomic layout (`row`)",
    "flat": "ours + `FlatAdamW`",
    "lean": "ours + `FlatAdamW`, `persistent_param_shard=False`",
    "fsdp2": "torch FSDP2",
    "floor": "floor (plain model, no communication)",
}
HEADER = "<!-- made by tools/render_results.py from tools/results/bench_fsdp.json: rerun it, do not edit -->"


def _f(x: Optional[float], spec: str = ".2f") -> str:
    return "" if x is None else f"{x:{spec}}"


def _timed_rows(mode: str, res: dict) -> list[str]:
    methods = res["methods"]
    fsdp2, floor = methods.get("fsdp2", {}), methods.get("floor", {})
    rows = []
    for name in ("ours", "row", "flat", "lean", "fsdp2", "floor"):
        m = methods.get(name)
        if m is None:
            continue
        label = LABELS[name] + (" + BF16 main grads" if name == "flat" and mode == "bf16" else "")

        def over(other: dict, key: str) -> Optional[float]:
            x, y = m.get(key), other.get(key)
            return x / y if x is not None and y else None

        peak = m.get("peak_bytes")
        peak_txt = "" if peak is None else f"{peak / MIB:.1f} ({_f(over(fsdp2, 'peak_bytes'))})"
        comm = m.get("comm")
        if comm and comm.get("collectives") is not None and name != "floor":
            k = split_kinds(comm["collectives"])
            coll, sent = f"{k['all_gather']} / {k['reduce_scatter']}", f"{comm['bytes_sent'] / MIB:.1f}"
        else:
            coll = sent = ""
        rows.append(f"| {mode} | {label} | {_f(m.get('median_ms'), '.0f')} | {_f(over(fsdp2, 'median_ms'))} | "
                    f"{_f(over(floor, 'median_ms'))} | {peak_txt} | {coll} | {sent} |")
    return rows


def _setup(run: dict) -> str:
    """A timed mode's provenance: model, sizes, world, steps, date, host and command."""
    res, cfg = run["result"], run["config"]
    return (f"{run.get('model', 'Llama')}; vocab {cfg['vocab']}, dim {cfg['dim']}, {cfg['layers']} layers, "
            f"batch {cfg['batch']}x{cfg['seq']} per rank, world {run['world']} ({run['backend']}, "
            f"{run['threads_per_rank']} thread per rank); median of {res['steps']} timed steps per method, "
            f"interleaved. {run['date']}, {describe_host(run)}; `{run['command']}`.")


def _timed_notes(mode: str, run: dict, setup: str) -> list[str]:
    res = run["result"]
    notes = [f"* {mode}: {setup}"]
    r = res["ratios"]
    if r.get("cpu_ours_over_floor_plus_c10d") is not None:
        notes.append(f"  The framework's own share (ours' CPU time / (floor + its c10d calls replayed alone)): "
                     f"{r['cpu_ours_over_floor_plus_c10d']:.2f}; no step can be below "
                     f"{r['bound_step_ours_over_floor']:.2f} of the floor on this host"
                     + (f", so none of ours below {r['bound_step_ours_over_fsdp2']:.2f} of this run's FSDP2 step."
                        if r.get("bound_step_ours_over_fsdp2") is not None else "."))
    above = ours_above_floor(res["methods"], res.get("fault_us"))
    if above is not None and "beyond_c10d" in above:
        text = above_text(above)
        notes.append(f"  {text[0].upper()}{text[1:]}.")
    return notes


def _counts_table(run: dict) -> list[str]:
    counts = run["counts"]
    methods = [m for m in counts["methods"] if m != "fsdp2"] + ["fsdp2"]
    names = " / ".join("FSDP2" if m == "fsdp2" else m for m in methods)
    lines = [f"| mode | model | all-gathers {names} | reduce-scatters {names} | all collectives {names} |",
             "| --- | --- | --- | --- | --- |"]
    for mode in _ordered(counts["modes"], TIMED_MODES):
        by_model = counts["modes"][mode]
        for model in _ordered(by_model, MODELS):
            got = by_model[model]
            kinds = {m: split_kinds(got[m]["collectives"]) for m in methods if m in got}
            cell = lambda key: " / ".join(str(kinds[m][key]) for m in methods if m in kinds)  # noqa: E731
            lines.append(f"| {mode} | {model} | {cell('all_gather')} | {cell('reduce_scatter')} | {cell('all')} |")
    cfg = counts["config"]
    lines.append("")
    lines.append(f"* Collectives per training step (one step after {cfg['warmup']} warmup, world {counts['world']}; "
                 f"vocab {cfg['vocab']}, dim {cfg['dim']}, {cfg['layers']} layers): llama = fully_shard per block + root; head_root = the embedding its own unit, the root holding "
                 "only the final norm and lm_head; float8 = `Float8RowwiseWeight` linear weights (tensor subclass). "
                 f"{run['date']}, {describe_host(run)}; `{run['command']}`.")
    return lines


def _ordered(keys, order) -> list:
    """``keys`` in the order of ``order``, then any others as they come (JSON sorts them)."""
    return [k for k in order if k in keys] + [k for k in keys if k not in order]


def render(data: dict) -> str:
    """The markdown of a bench_fsdp results file (``tools.kit.results.load``'s dict); only the
    modes it holds."""
    runs = data.get("runs", {})
    lines = [HEADER]
    timed = [m for m in TIMED_MODES if m in runs]
    if timed:
        lines += ["", "| mode | method | step ms | / FSDP2 | / floor | peak MiB (/ FSDP2) | "
                      "all-gathers / reduce-scatters per step | MiB sent per step |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for mode in timed:
            lines += _timed_rows(mode, runs[mode]["result"])
        lines.append("")
        setups: dict[str, str] = {}
        for mode in timed:  # a mode measured in the same run as one before says so, not it all again
            setup = _setup(runs[mode])
            same = next((m for m, s in setups.items() if s == setup), None)
            setups[mode] = setup
            lines += _timed_notes(mode, runs[mode], f"the same model, run and host as {same}." if same else setup)
    if "counts" in runs:
        lines += [""] + _counts_table(runs["counts"])
    if len(lines) == 1:
        lines += ["", "No results yet: run `python3 tools/bench_fsdp.py` (and `--counts`), then "
                      "`python3 tools/render_results.py`."]
    return "\n".join(lines) + "\n"
