"""Items 3 and 4: memory per rank on a fake world of 8, and bench_gpu's world-1 step time and peak.

Both reuse ``tools/bench_gpu.py`` (its methods ``ours``, ``row``, ``fsdp2``, ``flat``,
``flat_bf16_state``, ``floor`` from
``tools/step_bench/methods.py``, on the text data) at a size that fits gpu_check's budget:

* ``memory``: :func:`tools.bench_gpu.measure_fake`, rank 0 of torch's fake process group of 8
  (collectives do nothing, so values are meaningless; allocations are real): the peak per rank
  that sharding leaves, each sharded method alone. Checked: ours and row within
  :data:`PEAK_LIMIT` of FSDP2's peak (they hold the same shards, so a larger ratio is a leak or a
  buffer kept too long).
* ``memory`` also runs ``tools/bench_host.py``'s measurement on the same fake world (``host`` rows):
  the training thread's CPU time per unit per step above the plain model, ours, row, FSDP2 and ours +
  ``FlatAdamW``, by phase, at a launch-bound size on CUDA (many short kernels: the host's time is
  what a GPU cannot hide). Figures; checked: every unit's pre-forward hook ran once in the
  profiled step.
* ``bench``: :func:`tools.bench_gpu.measure_real` at world 1 (NCCL on cuda:0, gloo on the CPU):
  median step time, methods interleaved, each method's peak alone, and its optimizer step timed
  alone against the bytes it must move (the bandwidth it reaches). Timings are figures, not
  checks (a shared machine is noisy); checked: the three sharded methods end at the same loss,
  which also shows that the timed code trains. ``singleton_groups_communicate`` stays off here:
  FSDP2 skips its collectives at world 1, so ours does too, as it does by default.
"""

from __future__ import annotations

from tools.gpu_checks.common import Context, Setup
from tools.gpu_checks.rows import Row

SIZES = {
    "cpu": dict(vocab=512, dim=64, layers=2, heads=4, hidden=176, seq=32, batch=2, steps=2, warmup=1),
    "cuda": dict(vocab=32000, dim=2048, layers=4, heads=16, hidden=5632, seq=1024, batch=4, steps=5, warmup=2),
}
HOST_SIZES = {  # tools/bench_host.py's model: many small units
    "cpu": dict(vocab=512, dim=64, layers=4, heads=4, hidden=176, seq=32, batch=2, steps=2, warmup=1),
    "cuda": dict(vocab=8192, dim=512, layers=16, heads=8, hidden=1408, seq=256, batch=1, steps=5, warmup=2),
}
MODES = ("fp32", "bf16")
PEAK_LIMIT = 1.25  # ours' and row's peak per rank at world 8, at most this times FSDP2's
LOSS_AGREE = {"fp32": 1e-3, "bf16": 1e-2}  # |last loss - FSDP2's| of ours and row
FAKE_WORLD = 8


def names(setup: Setup, section: str) -> list[str]:
    if section == "memory":
        return [f"fake w{FAKE_WORLD} {m}" for m in MODES] + [f"host {m}" for m in MODES]
    return [f"world 1 {m}" for m in MODES]


def config(setup: Setup, dtypes: tuple):
    from tools.step_bench.methods import BenchConfig

    s = SIZES[setup.device]
    return BenchConfig(dtypes=dtypes, vocab=s["vocab"], dim=s["dim"], layers=s["layers"], heads=s["heads"],
                       hidden=s["hidden"], seq=s["seq"], batch=s["batch"], steps=s["steps"], warmup=s["warmup"],
                       data="text", methods=("ours", "row", "fsdp2", "floor"))


def describe(setup: Setup) -> str:
    s = SIZES[setup.device]
    return (f"Llama dim {s['dim']} x {s['layers']} layers, {s['heads']} heads, SwiGLU {s['hidden']}, vocab "
            f"{s['vocab']}, batch {s['batch']} x {s['seq']} per rank (text); median of {s['steps']} steps after "
            f"{s['warmup']}")


def _mib(x: float) -> float:
    return round(x / 2**20, 1)


def _memory_row(setup: Setup, mode: str, row: Row) -> None:
    from tools.bench_gpu import measure_fake

    peaks = measure_fake(config(setup, (mode,)), setup.torch_device, FAKE_WORLD)[mode]["peak"]
    row.figures["peak MiB/rank"] = {name: _mib(v) for name, v in peaks.items()}
    for name in ("ours", "row"):
        row.check(f"{name} peak / FSDP2", peaks[name] / peaks["fsdp2"], PEAK_LIMIT)


def run_memory(ctx: Context) -> None:
    if ctx.setup.cuda:
        import torch

        torch.cuda.set_device(0)
    for mode in MODES:
        ctx.row(f"fake w{FAKE_WORLD} {mode}", lambda row, mode=mode: _memory_row(ctx.setup, mode, row))
    for mode in MODES:
        ctx.row(f"host {mode}", lambda row, mode=mode: _host_row(ctx.setup, mode, row))


def _host_row(setup: Setup, mode: str, row: Row) -> None:
    from tools.bench_host import PHASES, measure, per_unit
    from tools.step_bench.methods import BenchConfig

    s = HOST_SIZES[setup.device]
    cfg = BenchConfig(dtypes=(mode,), data="random", methods=("ours", "row", "fsdp2", "flat", "floor"), **s)
    result = measure(cfg, FAKE_WORLD, mode, setup.torch_device)
    ms = per_unit(cfg, result)
    row.figures["host ms/unit/step"] = {name: round(sum(v), 3) for name, v in ms.items()}
    row.figures["by phase"] = {name: dict(zip(PHASES, (round(x, 3) for x in v))) for name, v in ms.items()}
    for name in ("ours", "row", "flat"):
        row.figures[f"{name}/FSDP2 host"] = round(sum(ms[name]) / sum(ms["fsdp2"]), 3)
    row.figures["block unshard+reshard us (warm, cache flushed)"] = {
        name: [round(x, 1) for x in result["cycles"][name]] for name in ("ours", "fsdp2")}
    calls = sum(e.count for e in result["ranges"] if e.key.split(" (", 1)[0] == "fsdp::pre_forward")
    row.check("fsdp::pre_forward calls / units", calls / (cfg.layers + 1), 1.0, op="==")


def _bench_row(setup: Setup, mode: str, row: Row) -> None:
    from tools.bench_gpu import measure_real

    r = measure_real(config(setup, (mode,)), setup.torch_device)[mode]
    t, peak, loss = r["time"], r["peak"], r["loss"]
    row.figures["step ms"] = {name: round(1e3 * v, 2) for name, v in t.items()}
    row.figures["ours/FSDP2 step"] = round(t["ours"] / t["fsdp2"], 3)
    row.figures["peak MiB"] = {name: _mib(v) for name, v in peak.items()}
    row.figures["last loss"] = {name: round(v, 4) for name, v in loss.items()}
    opt = r["optim"]
    row.figures["optimizer ms"] = {name: round(1e3 * v["s"], 3) for name, v in opt.items()}
    row.figures["optimizer GB/s"] = {name: round(v["bytes"] / v["s"] / 1e9, 1) for name, v in opt.items()}
    for name in ("ours", "row"):
        row.check(f"{name} loss - FSDP2's", abs(loss[name] - loss["fsdp2"]), LOSS_AGREE[mode])


def run_bench(ctx: Context) -> None:
    from tools.gpu_checks.common import world_one

    with world_one(ctx.setup):
        for mode in MODES:
            ctx.row(f"world 1 {mode}", lambda row, mode=mode: _bench_row(ctx.setup, mode, row))
