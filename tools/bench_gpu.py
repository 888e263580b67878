"""One Llama training step on a GPU: ours (both layouts) against torch FSDP2 and the compute floor,
for the day a GPU is lent (on CPU the same code runs on gloo, which is how the tests check it).

    python3 tools/bench_gpu.py --cuda                    # one GPU: world 1 on NCCL, then fake world 8
    python3 tools/bench_gpu.py --cuda --dim 1024 --layers 4 --steps 5   # a quicker look
    python3 tools/bench_gpu.py --dim 64 --layers 2 --vocab 512 --seq 32  # the same code on CPU

Two parts, each in fp32 and in bf16 (the policies of ``tools/bench_fsdp.py``: bf16 compute, fp32
main weights, gradients and reductions for ours and FSDP2; the floor a bf16 copy of the model):

* **World 1, real** (NCCL on ``cuda:0``, gloo on CPU): ``ours``, ``row`` (``layout_policy("auto")``),
  ``fsdp2``, ``flat`` (``fsdp.FlatAdamW``; in bf16 with BF16 main grads), ``flat_bf16_state``
  (flat with BF16 Adam moments: ``FlatAdamW(state_dtype=torch.bfloat16)``) and ``floor`` (the plain
  model) train their own copies of one model on the same batches (``--micro``: each step over that
  many micro-batches, gradients accumulated). Step time: the median over ``--steps`` steps, methods
  interleaved round-robin, each step from a synchronised start to a synchronised end. Peak memory:
  each method alone, built, warmed up, then one step, as the device's peak allocated bytes above
  what was allocated before it was built (on CPU: the tensor storages the step holds or touches).
  The losses at the end must agree between ``ours``, ``row`` and ``fsdp2`` (they train the same
  model the same way). The optimizer step: two more steps each, the optimizer timed alone from
  and to an idle device, against the bytes it must read and write (weights and state read and
  written, gradients read: ``tools.step_bench.methods.optimizer_bytes``), so MB / ms is the
  bandwidth it reaches (an H200's HBM: about 4.8 TB/s).
* **World 8, fake** (``torch.testing``'s fake process group: collectives do nothing, so values
  are meaningless and only memory counts): rank 0 of eight, each method alone as above. This is
  what sharding saves per rank, ours against FSDP2, without eight GPUs.

It prints one table per part and the ratios ours/FSDP2 next to what Megatron-FSDP reports against
FSDP2 on GPUs (up to 25% faster steps, 23% less memory: ratios 0.80 and 0.77).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tools.kit import launch  # noqa: E402
from tools.kit.memory import StorageTracker  # noqa: E402
from tools.step_bench.methods import BenchConfig, build_method, make_batches, model_config, optimizer_bytes  # noqa: E402

METHODS = ("ours", "row", "fsdp2", "flat", "flat_bf16_state", "floor")
SHARDED = ("ours", "row", "fsdp2", "flat", "flat_bf16_state")
MEGATRON_FSDP = {"step": 0.80, "peak": 0.77}  # Megatron-FSDP's reported ratios to FSDP2 on GPUs


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_alone(name: str, base, mode: str, cfg: BenchConfig, mesh, batches, device: torch.device) -> int:
    """Bytes one method's step peaks at, alone: built, one warm-up step, then one measured step."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated(device)
    method = build_method(name, base, mode, cfg, mesh)
    method.step(batches[0])
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        method.step(batches[1])
        _sync(device)
        peak = torch.cuda.max_memory_allocated(device) - before
    else:
        with StorageTracker() as tracker:
            tracker.track(list(method.model.parameters()), list(method.model.buffers()), method.opt.state_dict()["state"])
            method.step(batches[1])
        peak = tracker.peak
    del method
    gc.collect()
    return peak


def _setup(cfg: BenchConfig, device: torch.device, world: int, rank: int):
    from tests.models.llama import Llama
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(cfg.seed)
    base = Llama(model_config(cfg)).to(device)
    mesh = init_device_mesh(device.type, (world,))
    batches = [b.to(device) for b in make_batches(cfg, cfg.warmup + (cfg.steps or 1) + 2, rank, world)]
    return base, mesh, batches


def measure_real(cfg: BenchConfig, device: torch.device) -> dict:
    """World 1 (the default group): per mode, each method's median step time (s), peak bytes and
    last loss."""
    out = {}
    for mode in cfg.dtypes:
        base, mesh, batches = _setup(cfg, device, 1, 0)
        peaks = {name: _peak_alone(name, base, mode, cfg, mesh, batches, device) for name in METHODS}
        methods = {name: build_method(name, base, mode, cfg, mesh) for name in METHODS}
        times: dict[str, list[float]] = {name: [] for name in METHODS}
        losses = {}
        for i, tokens in enumerate(batches[: cfg.warmup + cfg.steps]):
            order = METHODS[i % len(METHODS):] + METHODS[: i % len(METHODS)]
            for name in order:
                _sync(device)
                start = time.perf_counter()
                loss = methods[name].step(tokens)
                _sync(device)
                if i >= cfg.warmup:
                    times[name].append(time.perf_counter() - start)
                losses[name] = float(loss)
        # Then two more steps each, the optimizer step timed alone from and to an idle device (the
        # waits would break the overlap the timed steps above keep).
        for name in METHODS:
            methods[name].clock = lambda: (_sync(device), time.perf_counter())[1]
            for tokens in batches[cfg.warmup + cfg.steps: cfg.warmup + cfg.steps + 2]:
                methods[name].step(tokens)
        optim = {n: {"s": statistics.median(methods[n].optimizer_s),
                     "bytes": optimizer_bytes(methods[n])} for n in METHODS}
        out[mode] = {"time": {n: statistics.median(times[n]) for n in METHODS}, "peak": peaks, "loss": losses,
                     "optim": optim}
        del methods
    return out


def measure_fake(cfg: BenchConfig, device: torch.device, world: int) -> dict:
    """Rank 0 of a fake world: per mode, each sharded method's peak bytes."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        out = {}
        for mode in cfg.dtypes:
            base, mesh, batches = _setup(cfg, device, world, 0)
            out[mode] = {"peak": {name: _peak_alone(name, base, mode, cfg, mesh, batches, device) for name in SHARDED}}
        return out
    finally:
        dist.destroy_process_group()


def report(real: dict, fake: dict, cfg: BenchConfig, device: torch.device, fake_world: int) -> list[str]:
    """The tables and the comparison with Megatron-FSDP, as lines."""
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (gloo; peak = tensor storages)"
    lines = [f"{where}; torch {torch.__version__}; Llama dim {cfg.dim} x {cfg.layers} layers, vocab {cfg.vocab}, "
             f"batch {cfg.batch} x {cfg.seq} in {cfg.micro} micro-batch(es); median of {cfg.steps} steps after "
             f"{cfg.warmup}; optimizer: median of 2 more steps, each timed alone"]
    for mode in cfg.dtypes:
        r, f = real[mode], fake[mode]
        t, p, fp, opt = r["time"], r["peak"], f["peak"], r["optim"]
        lines += [f"== {mode}", f"| method | step ms (world 1) | / FSDP2 | / floor | peak MiB world 1 (/ FSDP2) "
                  f"| peak MiB world {fake_world} fake (/ FSDP2) | optimizer ms | optimizer MB moved | GB/s | loss |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for name in METHODS:
            world8 = f"{fp[name] / 2**20:.1f} ({fp[name] / fp['fsdp2']:.2f})" if name in fp else ""
            o = opt[name]
            lines.append(f"| {name} | {1e3 * t[name]:.1f} | {t[name] / t['fsdp2']:.2f} | {t[name] / t['floor']:.2f} | "
                         f"{p[name] / 2**20:.1f} ({p[name] / p['fsdp2']:.2f}) | {world8} | {1e3 * o['s']:.2f} | "
                         f"{o['bytes'] / 1e6:.1f} | {o['bytes'] / o['s'] / 1e9:.1f} | {r['loss'][name]:.4f} |")
        for name in ("ours", "row", "flat", "flat_bf16_state"):
            step, peak = t[name] / t["fsdp2"], fp[name] / fp["fsdp2"]
            lines.append(f"{name}/FSDP2: step {step:.2f} (Megatron-FSDP reports {MEGATRON_FSDP['step']:.2f}), "
                         f"peak memory at world {fake_world} {peak:.2f} (Megatron-FSDP {MEGATRON_FSDP['peak']:.2f})")
    return lines


def _real_rank(cfg: BenchConfig, cuda: bool, result_path: str) -> None:
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    torch.save(measure_real(cfg, device), result_path)


def main(argv: Optional[list[str]] = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cuda", action="store_true", help="run on cuda:0 with NCCL (default: CPU, gloo)")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "both"), default="both")
    parser.add_argument("--fake-world", type=int, default=8, help="ranks of the fake world for memory")
    for name, default in (("vocab", 32000), ("dim", 2048), ("layers", 8), ("heads", 16), ("seq", 1024),
                          ("batch", 4), ("micro", 1), ("steps", 10), ("warmup", 2)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--hidden", type=int, default=None, help="SwiGLU hidden size (default: 11/4 x dim)")
    args = parser.parse_args(argv)
    if args.cuda and not torch.cuda.is_available():
        parser.error("--cuda: no CUDA device here")
    if args.micro < 1 or args.batch % args.micro:
        parser.error(f"--micro must be a positive divisor of --batch ({args.batch}), got {args.micro}")
    if args.fake_world < 2:
        parser.error(f"--fake-world must be at least 2 (the ranks memory is sharded over), got {args.fake_world}")
    cfg = BenchConfig(
        dtypes=("fp32", "bf16") if args.dtype == "both" else (args.dtype,), vocab=args.vocab, dim=args.dim,
        layers=args.layers, heads=args.heads, hidden=args.hidden or 11 * args.dim // 4, seq=args.seq,
        batch=args.batch, micro=args.micro, steps=args.steps, warmup=args.warmup, data="random", methods=METHODS,
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/real.pt"
        launch.spawn(1, _real_rank, cfg, args.cuda, path, backend="nccl" if args.cuda else "gloo",
                     threads=None, cuda=args.cuda)
        real = torch.load(path)
    device = torch.device("cuda", 0) if args.cuda else torch.device("cpu")
    if args.cuda:
        torch.cuda.set_device(device)
    fake = measure_fake(cfg, device, args.fake_world)
    lines = report(real, fake, cfg, device, args.fake_world)
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main()
