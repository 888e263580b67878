"""CPU offload, each choice of what goes to the host: device peak memory per rank and step time,
against no offload and against torch FSDP2's ``CPUOffloadPolicy``.

    python3 tools/bench_offload.py                       # CPU, rank 0 of a fake world of 8
    python3 tools/bench_offload.py --dim 64 --layers 1 --vocab 256 --steps 2   # a quick check
    python3 tools/bench_offload.py --optim torch         # ours with torch.optim.AdamW, not FlatAdamW
    python3 tools/bench_offload.py --cuda                # cuda:0, the same fake world

Trains the Llama-style decoder of ``tests/models/llama.py`` (``fully_shard`` per block + root) as
rank 0 of a world of ``--world`` ranks on torch's fake process group (collectives do nothing:
values are meaningless, shapes and memory per rank are real), five ways in one run:

* ``no_offload``: fsdp without offload;
* ``state_device``: ``fsdp.OptimizerStateOffloadPolicy(step="device")``, the optimizer state on the
  host, the step on the device with the states streamed in and out;
* ``state_host``: ``OptimizerStateOffloadPolicy(step="host")``, the step on the host;
* ``everything``: fsdp with ``CPUOffloadPolicy`` (main weights, grads and state on the host);
* ``fsdp2_cpu_offload``: ``torch.distributed.fsdp.fully_shard`` with ``CPUOffloadPolicy`` and
  ``torch.optim.AdamW``.

fsdp's methods step with ``fsdp.FlatAdamW`` (``--optim flat``, default; ``--chunk-numel`` its
chunk) or ``torch.optim.AdamW`` (``--optim torch``). Step time: the median over ``--steps``
interleaved steps (after ``--warmup``), each between two synchronisations. Device peak memory
per rank: each method alone, one step after its warm-up; on CUDA the device's peak allocated
bytes above what was allocated before the method was built; on CPU, where host and "device"
memory are one, the peak of the tensor storages the step holds or touches minus those in host
memory at each moment (``tools.kit.memory.DeviceTracker``): for fsdp, every storage its offload
parts allocated through the ``HostTransfers`` seam (recorded by this tool's factory) and, under
``CPUOffloadPolicy``, the optimizer state (torch's ``zeros_like`` of host weights); for FSDP2 its
sharded parameters, their gradients and the optimizer state. Then the ratios to no offload and
ours (everything on the host) / FSDP2's ``CPUOffloadPolicy``. On CPU the copies are host to host
and the host step competes with nothing: read the memory, and the step times as a CPU's.
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import sys
import time
import weakref
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.models.llama import Llama, LlamaConfig, loss_fn  # noqa: E402
from tools.kit.memory import DeviceTracker  # noqa: E402

METHODS = ("no_offload", "state_device", "state_host", "everything", "fsdp2_cpu_offload")
ON_HOST = {
    "no_offload": "nothing",
    "state_device": "optimizer state (step on the device)",
    "state_host": "optimizer state (step on the host)",
    "everything": "main weights, grads, optimizer state",
    "fsdp2_cpu_offload": "weights, grads, optimizer state (FSDP2)",
}


class HostStorages:
    """The storages fsdp's offload parts allocated in host memory: a ``HostTransfers`` factory
    (installed as ``fsdp.compose.offload.TRANSFERS``) that records each host tensor's storage."""

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref] = {}

    def factory(self, make: Callable) -> Callable:
        def transfers(device: torch.device, pin_memory: bool):
            made = make(device, pin_memory)
            host_tensor = made.host_tensor

            def recorded(numel: int, dtype: torch.dtype, zero: bool) -> torch.Tensor:
                t = host_tensor(numel, dtype, zero)
                st = t.untyped_storage()
                self._refs[st._cdata] = weakref.ref(st)
                return t

            made.host_tensor = recorded
            return made

        return transfers

    def keys(self) -> set:
        return {key for key, ref in self._refs.items() if ref() is not None}


def _keys(tensors) -> set:
    out = set()
    for t in tensors:
        if isinstance(t, torch.Tensor):
            out.add(getattr(t, "_local_tensor", t).untyped_storage()._cdata)
    return out


def _state_tensors(opt) -> list:
    return [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]


def build(name: str, base: torch.nn.Module, mesh, args) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """``base`` copied and sharded the way ``name`` says, with its AdamW."""
    model = copy.deepcopy(base)
    if name == "fsdp2_cpu_offload":
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        kw = dict(mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=args.cuda))
    else:
        import fsdp

        fully_shard = fsdp.fully_shard
        policies = {
            "no_offload": fsdp.OffloadPolicy(),
            "state_device": fsdp.OptimizerStateOffloadPolicy(step="device"),
            "state_host": fsdp.OptimizerStateOffloadPolicy(step="host"),
            "everything": fsdp.CPUOffloadPolicy(pin_memory=True),
        }
        kw = dict(mesh=mesh, offload_policy=policies[name])
    for block in model.layers:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    if name != "fsdp2_cpu_offload" and args.optim == "flat":
        import fsdp

        return model, fsdp.FlatAdamW(model, lr=1e-3, chunk_numel=args.chunk_numel)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def host_keys(name: str, model, opt, recorded: HostStorages) -> Callable[[], set]:
    """What of ``name``'s memory is in host memory, asked at each moment (see the docstring)."""
    params = list(model.parameters())
    if name == "fsdp2_cpu_offload":
        return lambda: _keys(params) | _keys(p.grad for p in params) | _keys(_state_tensors(opt))
    if name == "everything":
        return lambda: recorded.keys() | _keys(_state_tensors(opt))
    return recorded.keys


def step(model, opt, tokens: torch.Tensor) -> None:
    loss_fn(model(tokens[:, :-1]), tokens).backward()
    opt.step()
    opt.zero_grad()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_alone(name: str, base, mesh, batches, args, device: torch.device, recorded: HostStorages) -> int:
    """Device bytes one method's step peaks at, alone: built, warmed up, then one measured step."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated(device)
    model, opt = build(name, base, mesh, args)
    for tokens in batches[: max(args.warmup, 1)]:
        step(model, opt, tokens)
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        step(model, opt, batches[-1])
        _sync(device)
        return torch.cuda.max_memory_allocated(device) - before
    with DeviceTracker(host_keys(name, model, opt, recorded)) as tracker:
        tracker.track(list(model.parameters()), list(model.buffers()), _state_tensors(opt))
        step(model, opt, batches[-1])
    return tracker.device_peak


def measure(args, device: torch.device) -> dict:
    """Rank 0 of the fake world: every method's median step time (s) and device peak (bytes)."""
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp.compose import offload as offload_module

    cfg = LlamaConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                      hidden_dim=3 * args.dim, max_seq_len=args.seq)
    torch.manual_seed(0)
    base = Llama(cfg).to(device)
    mesh = init_device_mesh(device.type, (args.world,))
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g).to(device)
               for _ in range(args.warmup + args.steps + 1)]
    recorded = HostStorages()
    original = offload_module.TRANSFERS
    offload_module.TRANSFERS = recorded.factory(original)
    try:
        peaks = {name: _peak_alone(name, base, mesh, batches, args, device, recorded) for name in METHODS}
        methods = {name: build(name, base, mesh, args) for name in METHODS}
        times: dict[str, list[float]] = {name: [] for name in METHODS}
        for i, tokens in enumerate(batches[:-1]):
            order = METHODS[i % len(METHODS):] + METHODS[: i % len(METHODS)]
            for name in order:
                model, opt = methods[name]
                _sync(device)
                t0 = time.perf_counter()
                step(model, opt, tokens)
                _sync(device)
                if i >= args.warmup:
                    times[name].append(time.perf_counter() - t0)
    finally:
        offload_module.TRANSFERS = original
    return {"time": {n: statistics.median(times[n]) for n in METHODS}, "peak": peaks}


def report(result: dict, args, device: torch.device) -> list[str]:
    t, p = result["time"], result["peak"]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (peak: storages not in host memory)"
    optim = f"FlatAdamW (chunk_numel={args.chunk_numel})" if args.optim == "flat" else "torch.optim.AdamW"
    lines = [
        f"rank 0 of a fake world of {args.world}, {where}; Llama dim {args.dim} x {args.layers} layers, vocab "
        f"{args.vocab}, batch {args.batch} x {args.seq}; fsdp's methods step with {optim}, FSDP2 with "
        f"torch.optim.AdamW; median of {args.steps} steps after {args.warmup}",
        "| method | on the host | step ms | device peak MiB | step / no offload | peak / no offload |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name in METHODS:
        lines.append(f"| {name} | {ON_HOST[name]} | {1e3 * t[name]:.1f} | {p[name] / 2**20:.3f} | "
                     f"{t[name] / t['no_offload']:.2f} | {p[name] / p['no_offload']:.2f} |")
    fsdp2 = "fsdp2_cpu_offload"
    lines.append(f"everything on the host, ours / FSDP2's CPUOffloadPolicy: step time {t['everything'] / t[fsdp2]:.2f}, "
                 f"device peak {p['everything'] / p[fsdp2]:.2f}")
    for name in ("state_device", "state_host"):
        lines.append(f"{name} / FSDP2's CPUOffloadPolicy: step time {t[name] / t[fsdp2]:.2f}, "
                     f"device peak {p[name] / p[fsdp2]:.2f}")
    return lines


def main(argv: Optional[list[str]] = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=8, help="ranks of the fake world (memory per rank)")
    parser.add_argument("--cuda", action="store_true", help="run on cuda:0 (default: CPU)")
    parser.add_argument("--optim", choices=("flat", "torch"), default="flat",
                        help="fsdp's methods step with fsdp.FlatAdamW (default) or torch.optim.AdamW")
    parser.add_argument("--chunk-numel", type=int, default=None, help="FlatAdamW's chunk_numel (default: its own)")
    for name, default in (("dim", 256), ("layers", 4), ("heads", 4), ("vocab", 4096), ("seq", 64),
                          ("batch", 4), ("steps", 5), ("warmup", 1)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: a shared machine's noise hits every method alike; 0: torch's)")
    args = parser.parse_args(argv)
    if args.cuda and not torch.cuda.is_available():
        parser.error("--cuda: no CUDA device here")
    if args.world < 2:
        parser.error(f"--world must be at least 2 (the ranks memory is sharded over), got {args.world}")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # the fake world's values are garbage: no denormal slow paths
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from dbuffer.teardown import shutdown

    device = torch.device("cuda", 0) if args.cuda else torch.device("cpu")
    if args.cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world)
    try:
        lines = report(measure(args, device), args, device)
    finally:
        shutdown(collect=False)
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main()
