"""bench_fsdp's measured run: each method built, warmed up and measured alone (memory and
communication in one untimed step), then timed round-robin; the ratios and targets; and the
profile of one method. ``tools/bench_fsdp.py``'s docstring says how each figure is taken.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import statistics
import sys
import time
from typing import Optional

import torch
import torch.distributed as dist

from tests.models.llama import Llama
from tools.kit.comm import CommCounter
from tools.kit.memory import StorageTracker, live_storages, release_library_caches
from tools.kit.timing import PHASES, fault_probe, gemm_probe
from tools.step_bench.methods import (
    DTYPES,
    MODELS,
    VARIANTS,
    BenchConfig,
    Method,
    ReplayMethod,
    build_method,
    check_config,
    make_batches,
    model_config,
    optimizer_impl,
    policy_text,
)
from tools.step_bench.report import fsdp_breakdown

# Targets of the current issue (34): (name, what, limit); a ratio must be <= its limit.
_KEPT = [("peak_ours_over_fsdp2", "peak memory ours/FSDP2", 1.0),
         ("ops_ours_over_fsdp2", "collectives per step ours/FSDP2", 1.0),
         ("all_gathers_ours_over_fsdp2", "all-gathers per step ours/FSDP2", 1.0),
         ("reduce_scatters_ours_over_fsdp2", "reduce-scatters per step ours/FSDP2", 1.0)]
TARGETS = {
    "fp32": [("step_ours_over_fsdp2", "step time ours/FSDP2", 0.75), *_KEPT],
    "bf16": [("step_ours_over_fsdp2", "step time ours/FSDP2", 0.75),
             ("cpu_ours_over_floor_plus_c10d", "CPU time ours/(floor + raw c10d), the framework's share", 1.10),
             *_KEPT],
}


def run_mode(mode: str, cfg: BenchConfig, mesh, counter: CommCounter, progress: bool = False) -> dict:
    """Build the methods for ``mode`` (``fp32`` / ``bf16``), warm each up and measure its memory
    and communication in one untimed step (one method at a time), then time them interleaved.
    Every rank returns the same dict."""
    rank, world = dist.get_rank(), dist.get_world_size()
    started = time.perf_counter()
    release_library_caches()
    steps = cfg.steps_for(mode)
    measured = 1 if cfg.measure else 0
    total = cfg.warmup + measured + steps
    batches = make_batches(cfg, total, rank, world)
    torch.manual_seed(cfg.seed)
    base = Llama(model_config(cfg))
    names = list(cfg.methods)
    losses = torch.zeros(len(names), total, dtype=torch.float64)
    stamps = torch.zeros(len(names), steps, 2, dtype=torch.float64)
    cpu = torch.zeros(len(names), steps, dtype=torch.float64)  # this process's CPU time, all threads
    peaks = torch.zeros(len(names), 2, dtype=torch.float64)  # [start of the measured step, peak]

    def log(text: str) -> None:
        if progress and rank == 0:
            print(f"  {mode} {text} ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)

    # One method at a time: build, warm up, measure. What the method holds at the measured step
    # is every storage alive then that was not alive before it was built (its parameters, grads,
    # optimizer state, library buffers and caches), plus whatever the step itself allocates.
    methods: dict[str, Method] = {}
    ours_trace: list = []  # the c10d calls of ours' last untimed step, which "c10d" replays
    for j, name in enumerate(names):
        gc.collect()
        before = live_storages()  # held, so that no new storage can reuse an old one's identity
        if name == "c10d":
            methods[name] = method = ReplayMethod(ours_trace)
        else:
            methods[name] = method = build_method(name, base, mode, cfg, mesh)
        record = counter.recording if name == "ours" else contextlib.nullcontext
        for i in range(cfg.warmup):
            dist.barrier()
            with record() as trace:
                losses[j, i] = method.step(batches[i]).item()
            ours_trace = trace if trace is not None else ours_trace
        if measured:
            i = cfg.warmup
            tracker = StorageTracker()
            tracker.track_new(before)
            start_bytes = tracker.current
            dist.barrier()
            with counter.counting(name), record() as trace, tracker:
                losses[j, i] = method.step(batches[i]).item()
            ours_trace = trace if trace is not None else ours_trace
            peaks[j, 0], peaks[j, 1] = start_bytes, tracker.peak
            del tracker
        before = None
        log(f"{name}: {cfg.warmup} warmup + {measured} measured step(s)")
    del base

    for method in methods.values():
        method.phases.clear()  # the breakdown covers the timed steps only
    for t in range(steps):
        i = cfg.warmup + measured + t
        for j in [(t + k) % len(names) for k in range(len(names))]:  # order rotated every step
            method = methods[names[j]]
            gc.collect()
            dist.barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            loss = method.step(batches[i])
            t1, c1 = time.perf_counter(), time.process_time()
            stamps[j, t] = torch.tensor([t0, t1], dtype=torch.float64)
            cpu[j, t] = c1 - c0
            losses[j, i] = loss.item()
        log(f"timed step {t + 1}/{steps}")

    # The ranks share one monotonic clock: a step runs from the last rank in to the last rank out.
    dist.all_reduce(stamps, op=dist.ReduceOp.MAX)
    all_cpu = [torch.zeros_like(cpu) for _ in range(world)]
    dist.all_gather(all_cpu, cpu)
    all_losses = [torch.zeros_like(losses) for _ in range(world)]
    dist.all_gather(all_losses, losses)
    all_peaks = [torch.zeros_like(peaks) for _ in range(world)]
    dist.all_gather(all_peaks, peaks)
    phases_by_rank = [None] * world
    dist.all_gather_object(phases_by_rank, {n: methods[n].phases for n in names})
    comm_by_rank = [None] * world
    dist.all_gather_object(comm_by_rank, {n: counter.stats.get(n) for n in names})
    counter.stats.clear()

    gemm = [None] * world
    dist.all_gather_object(gemm, gemm_probe({m: DTYPES[m] for m in ("fp32", mode)}))  # all ranks at once
    faults = [None] * world
    dist.all_gather_object(faults, fault_probe())  # all ranks at once, as the steps run
    result: dict = {
        "gemm_gflops": gemm[0],
        "fault_us": statistics.fmean(faults),
        "policy": {n: policy_text(mode)[n] for n in names},
        "optimizer": {n: f"{type(methods[n].opt).__name__} ({optimizer_impl(methods[n])})"
                      if methods[n].opt is not None else "no optimizer" for n in names},
        # Whether the ranks' compute threads fill every core the processes may run on: then the
        # communication's CPU time cannot hide behind compute (see "c10d").
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "busy_threads": world * torch.get_num_threads(),
        "steps": steps, "warmup": cfg.warmup, "measured_steps": measured,
        "methods": {},
    }
    for j, name in enumerate(names):
        ms = [1e3 * (b - a) for a, b in stamps[j].tolist()]
        srt = sorted(ms)
        entry: dict = {
            "times_ms": ms,
            "median_ms": statistics.median(ms) if ms else None,
            "mean_ms": statistics.fmean(ms) if ms else None,
            "min_ms": srt[0] if ms else None,
            "max_ms": srt[-1] if ms else None,
            "cpu_ms_by_rank": [[1e3 * x for x in r[j].tolist()] for r in all_cpu],
            "cpu_ms": statistics.median(1e3 * sum(r[j, t].item() for r in all_cpu) / world
                                        for t in range(steps)) if steps else None,
            "loss_by_rank": [r[j].tolist() for r in all_losses],
            "loss": [sum(r[j, i].item() for r in all_losses) / world for i in range(total)],
        }
        entry["phases"] = phase_breakdown([r[name] for r in phases_by_rank])
        if measured:
            entry["start_bytes_by_rank"] = [int(r[j, 0].item()) for r in all_peaks]
            entry["peak_bytes_by_rank"] = [int(r[j, 1].item()) for r in all_peaks]
            entry["peak_bytes"] = max(entry["peak_bytes_by_rank"])
            comm = [c[name] or {"calls": 0, "ops": 0, "bytes_sent": 0.0, "by_kind": {}, "collectives": {},
                                "library_ops": 0} for c in comm_by_rank]
            entry["comm_by_rank"] = comm
            kinds = sorted({k for c in comm for k in c["collectives"]})
            entry["comm"] = {"ops": max(c["ops"] for c in comm), "calls": max(c["calls"] for c in comm),
                             "bytes_sent": max(c["bytes_sent"] for c in comm), "by_kind": comm[0]["by_kind"],
                             "collectives": {k: max(c["collectives"].get(k, 0) for c in comm) for k in kinds}}
        result["methods"][name] = entry
    result["ratios"] = _ratios(result["methods"])
    result["ratios"].update(c10d_bound(result))
    result["ratios"].update(_paired_ratios(names, stamps))
    result["targets"] = [
        {"name": key, "what": what, "limit": limit, "value": result["ratios"].get(key),
         "met": (result["ratios"].get(key) is not None and result["ratios"][key] <= limit),
         "bound": result["ratios"].get(f"bound_{key}")}
        for key, what, limit in TARGETS[mode]
    ]
    result["wall_s"] = time.perf_counter() - started
    del methods
    gc.collect()
    return result


def phase_breakdown(by_rank: list[list]) -> Optional[dict]:
    """The CPU cost of a method's timed steps by phase (``forward``, ``backward``, ``optimizer``;
    the c10d replay has one, ``communication``): per phase the training thread's own CPU ms, the
    other threads' (gloo's) and the page faults, each the median over steps, averaged over ranks."""
    if not by_rank or not by_rank[0]:
        return None
    names = PHASES if len(by_rank[0][0]) == len(PHASES) else ("communication",)
    out = {}
    for p, phase in enumerate(names):
        out[phase] = {key: statistics.fmean(statistics.median(step[p][j] for step in steps) for steps in by_rank)
                      for j, key in enumerate(("own_ms", "other_ms", "faults"))}
    return out


def _paired_ratios(names: list[str], stamps: torch.Tensor) -> dict:
    """Median over rounds of the ratio of the steps run in that round (robust to slow drift)."""
    out = {}
    times = stamps[..., 1] - stamps[..., 0]
    for a, b in (("ours", "fsdp2"), ("ours", "floor"), ("row", "fsdp2"), ("row", "floor"), ("row", "ours")):
        if a in names and b in names and times.shape[1]:
            per_round = (times[names.index(a)] / times[names.index(b)]).tolist()
            out[f"paired_step_{a}_over_{b}"] = statistics.median(per_round)
    return out


def c10d_bound(result: dict) -> dict:
    """What the raw-c10d replay says about the floor comparison (nothing without "c10d" and
    "floor"). Where compute threads fill every core, each rank must spend the floor's CPU time
    and the communication's, so ``(floor + c10d) / floor`` of CPU time is the least ours/floor
    can be; with spare cores the communication can hide, and the bound is the longer of the two
    wall times over the floor's. With "fsdp2", the same least step over FSDP2's median."""
    m = result["methods"]
    floor, c10d, ours = m.get("floor"), m.get("c10d"), m.get("ours")
    if not (floor and c10d and floor.get("cpu_ms") and floor.get("median_ms")):
        return {}
    saturated = result["busy_threads"] >= result["cores"]
    if saturated:
        bound = (floor["cpu_ms"] + c10d["cpu_ms"]) / floor["cpu_ms"]
    else:
        bound = max(floor["median_ms"], c10d["median_ms"]) / floor["median_ms"]
    out = {"bound_step_ours_over_floor": bound, "cores_saturated": saturated,
           "cpu_c10d_over_floor": c10d["cpu_ms"] / floor["cpu_ms"]}
    fsdp2 = m.get("fsdp2")
    if fsdp2 and fsdp2.get("median_ms"):
        # The same least step against FSDP2's in this run: what ours/FSDP2 would be if the
        # framework cost nothing (a slower FSDP2 run lowers it, a faster one raises it).
        out["bound_step_ours_over_fsdp2"] = bound * floor["median_ms"] / fsdp2["median_ms"]
    if ours and ours.get("cpu_ms"):
        # Ours' CPU time beyond compute + raw communication: the framework's own cost.
        out["cpu_ours_over_floor_plus_c10d"] = ours["cpu_ms"] / (floor["cpu_ms"] + c10d["cpu_ms"])
    return out


def _ratios(m: dict) -> dict:
    def ratio(a, b, key):
        x, y = m.get(a, {}).get(key), m.get(b, {}).get(key)
        return x / y if x is not None and y else None

    def comm_ratio(key):
        x, y = m.get("ours", {}).get("comm"), m.get("fsdp2", {}).get("comm")
        return x[key] / y[key] if x and y and y[key] else None

    def collective_ratio(kind):  # the collectives the step asks for, however c10d carries them
        x, y = m.get("ours", {}).get("comm"), m.get("fsdp2", {}).get("comm")
        if not (x and y and y["collectives"].get(kind)):
            return None
        return x["collectives"].get(kind, 0) / y["collectives"][kind]

    variants = {}
    for v in VARIANTS:
        if v in m:
            variants[f"step_{v}_over_fsdp2"] = ratio(v, "fsdp2", "median_ms")
            variants[f"step_{v}_over_floor"] = ratio(v, "floor", "median_ms")
            variants[f"step_{v}_over_ours"] = ratio(v, "ours", "median_ms")
            variants[f"cpu_{v}_over_fsdp2"] = ratio(v, "fsdp2", "cpu_ms")
            variants[f"peak_{v}_over_fsdp2"] = ratio(v, "fsdp2", "peak_bytes")
            variants[f"peak_{v}_over_ours"] = ratio(v, "ours", "peak_bytes")
    return variants | {
        "step_ours_over_fsdp2": ratio("ours", "fsdp2", "median_ms"),
        "step_ours_over_floor": ratio("ours", "floor", "median_ms"),
        "step_fsdp2_over_floor": ratio("fsdp2", "floor", "median_ms"),
        "min_step_ours_over_fsdp2": ratio("ours", "fsdp2", "min_ms"),
        "min_step_ours_over_floor": ratio("ours", "floor", "min_ms"),
        "cpu_ours_over_fsdp2": ratio("ours", "fsdp2", "cpu_ms"),
        "cpu_ours_over_floor": ratio("ours", "floor", "cpu_ms"),
        "peak_ours_over_fsdp2": ratio("ours", "fsdp2", "peak_bytes"),
        "peak_ours_over_floor": ratio("ours", "floor", "peak_bytes"),
        "ops_ours_over_fsdp2": comm_ratio("ops"),
        "all_gathers_ours_over_fsdp2": collective_ratio("all_gather"),
        "reduce_scatters_ours_over_fsdp2": collective_ratio("reduce_scatter"),
        "calls_ours_over_fsdp2": comm_ratio("calls"),
        "sent_ours_over_fsdp2": comm_ratio("bytes_sent"),
    }


def run_benchmark(cfg: BenchConfig | dict, progress: bool = False) -> dict:
    """The benchmark on the current (initialised) process group; every rank returns the results."""
    from torch.distributed.device_mesh import init_device_mesh

    if isinstance(cfg, dict):
        cfg = BenchConfig(**cfg)
    check_config(cfg)
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    counter = CommCounter()
    counter.install()
    started = time.perf_counter()
    try:
        modes = {mode: run_mode(mode, cfg, mesh, counter, progress) for mode in cfg.dtypes}
    finally:
        counter.uninstall()
    return {
        "config": dataclasses.asdict(cfg),
        "world": world,
        "backend": str(dist.get_backend()),
        "threads_per_rank": torch.get_num_threads(),
        "torch": torch.__version__,
        "model": MODELS[cfg.model],
        "data": ("ByteText (standard-library sources, byte tokens)" if cfg.data == "text"
                 else f"uniform random tokens in [0, {cfg.vocab})"),
        "timing": "median over timed steps; last rank in (after a barrier) to last rank out; "
                  "methods round-robin, order rotated every step; cpu = process_time of a rank",
        "memory_method": "own StorageTracker (TorchDispatchMode + UntypedStorage.resize_ hook): live "
                         "untyped storages the method created since it was built (found through gc) or "
                         "that any op of the measured step touches; peak after any op or resize",
        "comm_method": "wrappers around torch.distributed collective and p2p functions during the "
                       "measured step; ops = collectives with one p2p all-gather/reduce-scatter "
                       "(W-1 isend + W-1 irecv) as one op; sent = bandwidth-optimal bytes per rank",
        "modes": modes,
        "wall_s": time.perf_counter() - started,
    }


def profile_method(name: str, mode: str, cfg: BenchConfig, steps: int = 2, top: int = 25) -> str:
    """Profile ``steps`` steps of one method (after ``cfg.warmup + 1`` unprofiled ones) on rank 0:
    torch.profiler operator table, then cProfile of the Python side. Every rank must call it."""
    import cProfile
    import io
    import pstats

    from torch.distributed.device_mesh import init_device_mesh

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(cfg.seed)
    method = build_method(name, Llama(model_config(cfg)), mode, cfg, mesh)
    warm = cfg.warmup + 1
    batches = make_batches(cfg, warm + 2 * steps, rank, world)
    for i in range(warm):
        method.step(batches[i])
    report = io.StringIO()
    dist.barrier()
    if rank == 0:
        from torch.profiler import ProfilerActivity, profile

        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for i in range(steps):
                method.step(batches[warm + i])
        step_ms = (time.perf_counter() - t0) * 1000 / steps
        averages = prof.key_averages()
        report.write(f"== torch.profiler, {name} {mode}, {steps} steps, rank 0: top {top} by self CPU ==\n")
        report.write(averages.table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=50))
        report.write(f"\n== fsdp's own ranges, {name} {mode}, rank 0, {step_ms:.1f} ms per profiled step ==\n")
        report.write(fsdp_breakdown(averages, steps, step_ms) + "\n")
    else:
        for i in range(steps):
            method.step(batches[warm + i])
    dist.barrier()
    prof_py = cProfile.Profile() if rank == 0 else None
    if prof_py is not None:
        prof_py.enable()
    t0 = time.perf_counter()
    for i in range(steps):
        method.step(batches[warm + steps + i])
    elapsed = time.perf_counter() - t0
    if prof_py is not None:
        prof_py.disable()
        report.write(f"\n== cProfile, {name} {mode}, {steps} steps ({elapsed:.2f} s profiled), rank 0 ==\n")
        for key in ("tottime", "cumulative"):
            stats = pstats.Stats(prof_py, stream=report)
            stats.sort_stats(key).print_stats(top)
    dist.barrier()
    return report.getvalue()
