"""Host time per unit per step: what a GPU cannot hide, measured where nothing else costs.

    python3 tools/bench_host.py                       # fake world 8, 16 blocks, fp32 and bf16
    python3 tools/bench_host.py --foreach on          # AdamW's foreach path (torch's default on GPUs)
    python3 tools/bench_host.py --cuda                # the same on cuda:0 (kernels queued, host time measured)

When kernels are short the step is the host's Python: every microsecond a framework spends per unit
on the host is a microsecond the GPU waits. This measures it without a GPU: this process plays rank
0 of torch's **fake process group** (collectives do nothing, so values are meaningless but every
framework line runs), on a Llama with many small blocks (compute near zero). For each method, the
training thread's CPU time per step, split into forward, backward and optimizer (``step`` +
``zero_grad``), minus the plain model's (``floor``: the same model unsharded, the same optimizer)
in the same round, divided by the number of units (the blocks and the root): the **host overhead
per unit per step**.

Methods: ``ours`` (``fsdp.fully_shard`` + ``torch.optim.AdamW`` over its DTensor parameters),
``row`` (ours under ``fsdp.layout_policy("auto")``, Megatron's flat row-atomic layout: no copy
out of each gather or into each reduction), ``fsdp2`` (torch's ``fully_shard`` + the same AdamW), ``flat`` (ours + ``fsdp.FlatAdamW``, BF16
main grads in bf16), ``floor``. Steps are interleaved (the methods round-robin, rotated every
step); per phase, the median over rounds of each method's time minus the floor's in that round
(paired: a round the host slowed slows the floor too). Printed per mode: the table (ms per unit
per step, total and by phase), ours/FSDP2 and flat/FSDP2 against the target (<= 0.5), and ours' ``fsdp::`` ranges per unit per step (one
profiled step: what the overhead is made of), and one block's ``unshard()`` + ``reshard()`` for ours
and FSDP2, warm and after a cache flush (in a step every hook runs with the caches cold, which
no count of calls shows). ``torch.optim``'s per-parameter DTensor dispatch is
in the optimizer column of ``ours`` and ``fsdp2`` alike; ``flat`` shows what a user gains with
``fsdp.FlatAdamW``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tools.kit.results import describe_host, host_info  # noqa: E402
from tools.step_bench.methods import BenchConfig, build_method, make_batches, model_config  # noqa: E402
from tools.step_bench.report import fsdp_breakdown  # noqa: E402

METHODS = ("ours", "row", "fsdp2", "flat", "floor")
PHASES = ("forward", "backward", "optimizer")
TARGET = 0.5  # host overhead per unit per step, ours / FSDP2 (issue: half FSDP2's)


def measure(cfg: BenchConfig, world: int, mode: str, device: torch.device) -> dict:
    """Rank 0 of a fake world of ``world``: per method, the median training-thread CPU ms per step
    of each phase, and ours' fsdp:: ranges of one profiled step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from tests.models.llama import Llama

    forget_sharding_caches()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        mesh = init_device_mesh(device.type, (world,))
        torch.manual_seed(cfg.seed)
        base = Llama(model_config(cfg)).to(device)
        methods = {name: build_method(name, base, mode, cfg, mesh) for name in METHODS}
        batches = [b.to(device) for b in make_batches(cfg, cfg.warmup + cfg.steps + 1, 0, world)]
        for i, tokens in enumerate(batches[: cfg.warmup + cfg.steps]):
            for name in METHODS[i % len(METHODS):] + METHODS[: i % len(METHODS)]:
                methods[name].step(tokens)
        phases, above = {}, {}
        floor = methods["floor"].phases[cfg.warmup:]
        for name, method in methods.items():
            timed = method.phases[cfg.warmup:]  # per step: (own thread ms, other threads ms, faults) per phase
            phases[name] = [statistics.median(step[k][0] for step in timed) for k in range(len(PHASES))]
            # paired: step i of every method ran in round i, so a slow round slows the floor too
            above[name] = [statistics.median(step[k][0] - base[k][0] for step, base in zip(timed, floor))
                           for k in range(len(PHASES))]
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            methods["ours"].step(batches[-1])
        cycles = {name: gather_cycle(methods[name].model.layers[cfg.layers // 2], device) for name in ("ours", "fsdp2")}
        return {"phases": phases, "above": above, "ranges": prof.key_averages(), "cycles": cycles}
    finally:
        dist.destroy_process_group()


def forget_sharding_caches() -> None:
    """Empty DTensor's sharding-propagation caches (Python's and the C++ fast path's). A mode run
    after another in this process would find there the entries of the last mode's destroyed mesh,
    which hash like its own and are compared at every optimizer op's lookup (a cost no training
    process, with its one mesh, pays): each mode starts as in a fresh process."""
    from torch.distributed.tensor import DTensor

    cached = DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding
    if hasattr(cached, "cache_clear"):
        cached.cache_clear()
    fast_path = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if fast_path is not None:
        fast_path()


def gather_cycle(block: torch.nn.Module, device: torch.device, rounds: int = 200) -> tuple[float, float]:
    """Host us of one ``unshard()`` + ``reshard()`` of a sharded block (the public API, which
    FSDP2's modules share): the median with the caches warm from the previous cycle, and after
    16 MiB were written (the data caches cold, as a step's compute leaves them). In a step every
    hook runs cold: the gap says how much of the host time is memory the hook path touches, not
    the work it does."""
    flush = torch.empty(4 << 20, device="cpu")
    for _ in range(20):
        block.unshard()
        block.reshard()
    times = {False: [], True: []}
    for k in range(2 * rounds):
        cold = bool(k % 2)
        if cold:
            flush.fill_(k)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter_ns()
        block.unshard()
        block.reshard()
        times[cold].append((time.perf_counter_ns() - start) / 1e3)
    return statistics.median(times[False]), statistics.median(times[True])


def per_unit(cfg: BenchConfig, result: dict) -> dict[str, list[float]]:
    """Per sharded method, ms per unit per step above the floor, by phase (:data:`PHASES`): the
    median over rounds of the method's time minus the floor's in the same round."""
    units = cfg.layers + 1  # the blocks and the root
    return {name: [ms / units for ms in result["above"][name]] for name in METHODS if name != "floor"}


def report(cfg: BenchConfig, world: int, mode: str, result: dict) -> list[str]:
    units = cfg.layers + 1
    floor = result["phases"]["floor"]
    per_unit_ms = per_unit(cfg, result)
    lines = [f"== {mode}: host CPU ms per unit per step above the plain model ({units} units; floor "
             f"{sum(floor):.1f} ms per step: " + ", ".join(f"{p} {v:.1f}" for p, v in zip(PHASES, floor)) + ")",
             f"  {'method':<7}{'total':>8}" + "".join(f"{p:>11}" for p in PHASES) + f"{'/ FSDP2':>10}"]
    fsdp2_total = sum(per_unit_ms["fsdp2"])
    for name, parts in per_unit_ms.items():
        total = sum(parts)
        lines.append(f"  {name:<7}{total:>8.3f}" + "".join(f"{v:>11.3f}" for v in parts)
                     + f"{total / fsdp2_total:>10.2f}")
    for name in ("ours", "row", "flat"):
        ratio = sum(per_unit_ms[name]) / fsdp2_total
        lines.append(f"  target host overhead per unit {name}/FSDP2 <= {TARGET}: {ratio:.2f} "
                     + ("MET" if ratio <= TARGET else "MISSED"))
    (ours_hot, ours_cold), (fsdp2_hot, fsdp2_cold) = result["cycles"]["ours"], result["cycles"]["fsdp2"]
    lines.append(f"  one block's unshard()+reshard(), host us: ours {ours_hot:.1f} warm, {ours_cold:.1f} after a 16 MiB "
                 f"cache flush; FSDP2 {fsdp2_hot:.1f} warm, {fsdp2_cold:.1f} flushed; ours/FSDP2 "
                 f"{ours_hot / fsdp2_hot:.2f} warm, {ours_cold / fsdp2_cold:.2f} flushed")
    breakdown = fsdp_breakdown(result["ranges"], steps=units)  # per unit: one step over every unit
    lines.append("  ours' fsdp:: ranges, one profiled step, per unit (calls and CPU ms inside each range):")
    lines.extend("    " + line for line in breakdown.splitlines())
    return lines


def main(argv=None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=("fp32", "bf16", "both"), default="both")
    parser.add_argument("--cuda", action="store_true", help="run on cuda:0 (default: CPU)")
    parser.add_argument("--world", type=int, default=8, help="ranks of the fake world (this process is rank 0)")
    parser.add_argument("--foreach", choices=("default", "on", "off"), default="default",
                        help="AdamW's foreach (default: torch's choice, the for-loop on CPU; GPUs default to on)")
    for name, default in (("layers", 16), ("dim", 64), ("heads", 4), ("hidden", 176), ("vocab", 512),
                          ("seq", 32), ("batch", 2), ("steps", 20), ("warmup", 2)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args(argv)
    if args.world < 2:
        parser.error(f"--world must be at least 2 (a sharded world), got {args.world}")
    if args.cuda and not torch.cuda.is_available():
        parser.error("--cuda: no CUDA device here")
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    cfg = BenchConfig(
        dtypes=("fp32", "bf16") if args.dtype == "both" else (args.dtype,), vocab=args.vocab, dim=args.dim,
        layers=args.layers, heads=args.heads, hidden=args.hidden, seq=args.seq, batch=args.batch,
        steps=args.steps, warmup=args.warmup, data="random", methods=METHODS,
        foreach={"default": None, "on": True, "off": False}[args.foreach],
    )
    lines = [f"host overhead per unit per step: Llama dim {cfg.dim} x {cfg.layers} blocks, vocab {cfg.vocab}, "
             f"batch {cfg.batch} x {cfg.seq}; {'cuda:0' if args.cuda else 'CPU'}, rank 0 of a fake world "
             f"of {args.world}; AdamW foreach "
             f"{args.foreach}; medians over {cfg.steps} interleaved rounds after {cfg.warmup}, paired with the floor's",
             f"host: {describe_host({'host': host_info()})}"]
    print("\n".join(lines), flush=True)
    device = torch.device("cuda", 0) if args.cuda else torch.device("cpu")
    if args.cuda:
        torch.cuda.set_device(device)
    for mode in cfg.dtypes:
        part = report(cfg, args.world, mode, measure(cfg, args.world, mode, device))
        print("\n".join(part), flush=True)
        lines += part
    return lines


if __name__ == "__main__":
    main()
