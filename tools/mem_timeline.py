"""Where a training step's memory peaks: an operator-level timeline of live bytes per method.

    python3 tools/mem_timeline.py                              # bench_fsdp's model, fp32, every method
    python3 tools/mem_timeline.py --dtype bf16 --methods ours,fsdp2,flat --layers 2 --dim 256

Builds the methods of ``tools/bench_fsdp.py`` (``tools/step_bench/methods.py``: same model,
policies, optimizers; world 2, gloo), runs ``--warmup`` steps of each, then one step under
:class:`TimelineTracker`, the ``StorageTracker`` bench_fsdp measures with (``tools/kit/memory.py``)
extended to record every operator and storage resize with the live total, the step's phase
(forward, backward, optimizer, zero_grad) and the source line that caused it. Rank 0 prints, per
method and phase, the peak, where it happened, and the live storages at that moment by category:

* ``main``: the sharded weights the optimizer updates (ours: ``main``; FSDP2: the sharded params);
* ``model shard``: ours' compute-dtype shard (bf16 policy), a separate buffer from ``main``;
* ``unsharded``: gathered weights (ours: ``unsharded``; FSDP2: all-gather outputs and unsharded params);
* ``grad_in``: ours' unsharded gradient buffer that a reduction reads;
* ``main grads``: reduced gradients (ours: ``main_grad``; FSDP2: the sharded params' ``.grad``);
* ``optimizer state``: the optimizer's state tensors;
* anything else by the phase and operator that created it (``fwd aten.mm``: an activation or a
  forward temporary; ``bwd ...``: gradients of activations, autograd's parameter gradients,
  reduction temporaries; ``before step``: caches and storages the step did not create).

The peak is the same quantity bench_fsdp reports (storages the method created since it was
built, plus whatever the step touches); this tool only says what makes it up.
"""

from __future__ import annotations

import argparse
import gc
import sys
import traceback
from collections import defaultdict
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.models.llama import Llama  # noqa: E402
from tools.kit import launch  # noqa: E402
from tools.kit.memory import (  # noqa: E402
    StorageTracker,
    live_storages,
    local_tensors,
    release_library_caches,
)
from tools.step_bench import methods as bench  # noqa: E402

MIB = 1 << 20
# Source files whose frames say *where* an allocation happens (innermost first wins).
_WHERE = ("/fsdp/", "/dbuffer/", "torch/distributed/fsdp/", "tests/models/llama.py", "torch/optim/",
          "torch/autograd/")


def _where() -> str:
    """The innermost frame of the stack in one of the interesting files, as ``file:line fn``."""
    for frame in reversed(traceback.extract_stack(limit=40)[:-3]):
        name = frame.filename.replace("\\", "/")
        if any(w in name for w in _WHERE) and "mem_timeline" not in name:
            short = "/".join(name.split("/")[-2:])
            return f"{short}:{frame.lineno} {frame.name}"
    return "?"


class TimelineTracker(StorageTracker):
    """A StorageTracker that also records, per phase, the peak, the op and source line at it, and
    the live storages then (categorised by ``classify``, called at each new phase maximum)."""

    def __init__(self, classify: Callable[[], dict[int, str]]) -> None:
        super().__init__()
        self.classify = classify
        self.phase = "before step"
        self.origin: dict[int, str] = {}  # storage key -> "phase op" that first touched it
        self.phase_peaks: dict[str, dict] = {}
        self.events = 0
        self._op = "start"
        self.timeline: list[tuple[int, str, str, str]] = []  # (live bytes, phase, op, where) per event

    def _account(self, st: torch.UntypedStorage) -> None:
        key = st._cdata
        if key not in self._live:
            self.origin[key] = f"{self.phase} {self._op} @ {_where()}"
        super()._account(st)

    def _note(self, op: str) -> None:
        self.events += 1
        self.peak = max(self.peak, self.current)
        self.timeline.append((self.current, self.phase, op, _where()))
        best = self.phase_peaks.get(self.phase)
        if best is None or self.current > best["bytes"]:
            categories = self.classify()
            live = defaultdict(int)
            for key, (ref, nbytes) in self._live.items():
                if nbytes:
                    live[categories.get(key) or self.origin.get(key, "?")] += nbytes
            self.phase_peaks[self.phase] = {"bytes": self.current, "op": op, "where": _where(),
                                            "event": self.events, "live": dict(live)}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._op = str(func.overloadpacket.__name__)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self._note(self._op)
        return out

    def __enter__(self):
        result = super().__enter__()
        tracker, inner = self, torch.UntypedStorage.resize_

        def resize_(st, size):
            tracker._op = "resize_"
            out = inner(st, size)
            tracker._note(f"resize_({size})")
            return out

        torch.UntypedStorage.resize_ = resize_
        return result


def _keys(*tensors) -> list[int]:
    out = []
    for t in tensors:
        if isinstance(t, torch.Tensor):
            for local in local_tensors(t):
                try:
                    out.append(local.untyped_storage()._cdata)
                except (RuntimeError, NotImplementedError):
                    pass
    return out


def classifier(method: bench.Method) -> Callable[[], dict[int, str]]:
    """A function mapping the storage keys of ``method``'s known buffers to their category."""
    model, opt = method.model, method.opt

    def optimizer_state(cats: dict[int, str]) -> None:
        for state in opt.state.values():
            for v in state.values():
                for key in _keys(v):
                    if torch.is_tensor(v) and v.numel() > 1:
                        cats.setdefault(key, "optimizer state")

    def ours() -> dict[int, str]:
        cats: dict[int, str] = {}
        seen = set()
        for m in model.modules():
            state = getattr(m, "_fsdp_state", None)
            if state is None or id(state) in seen:
                continue
            seen.add(id(state))
            for g in state.groups:
                w = g.weights
                for owner, name, label in ((g, "main", "main"), (w, "model", "model shard"), (w, "gathered", "gathered"),
                                           (w, "unsharded", "unsharded"), (g.grads, "grad_in", "grad_in"),
                                           (g.grads, "main_grad", "main grads")):
                    buf = getattr(owner, name, None)
                    if buf is not None:
                        for key in _keys(buf.local_buffer):
                            cats.setdefault(key, label)
                for p in g.sharded_params:
                    if p.grad is not None and p.grad.dtype != g.dtypes.main_grad:
                        for key in _keys(p.grad):
                            cats.setdefault(key, "param.grad cast copy")
        optimizer_state(cats)
        return cats

    def fsdp2() -> dict[int, str]:
        cats: dict[int, str] = {}
        for m in model.modules():
            get = getattr(m, "_get_fsdp_state", None)
            if get is None:
                continue
            state = get()
            groups = getattr(state, "_fsdp_param_groups", None)  # torch >= 2.12; 2.11 has one group
            if groups is None:
                groups = [g for g in [state._fsdp_param_group] if g is not None]
            for pg in groups:
                for fp in pg.fsdp_params:
                    for key in _keys(fp.sharded_param, getattr(fp, "_sharded_param_data", None)):
                        cats.setdefault(key, "main")
                    for key in _keys(fp.sharded_param.grad):
                        cats.setdefault(key, "main grads")
                    for key in _keys(*fp.all_gather_outputs, getattr(fp, "_unsharded_param", None)):
                        cats.setdefault(key, "unsharded")
        optimizer_state(cats)
        return cats

    def floor() -> dict[int, str]:
        cats: dict[int, str] = {}
        for p in model.parameters():
            for key in _keys(p):
                cats.setdefault(key, "main")
            for key in _keys(p.grad):
                cats.setdefault(key, "main grads")
        optimizer_state(cats)
        return cats

    return {"fsdp2": fsdp2, "floor": floor}.get(method.name, ours)


def phased_step(method: bench.Method, tokens: torch.Tensor, tracker: TimelineTracker) -> None:
    """``Method.step`` with the tracker told which phase runs."""
    for k, part in enumerate(tokens.chunk(method.micro), 1):
        tag = f" {k}" if method.micro > 1 else ""  # which micro-batch, under gradient accumulation
        tracker.phase = "fwd" + tag
        loss = method.loss_fn(method.model(part[:, :-1]), part) / method.micro
        tracker.phase = "bwd" + tag
        loss.backward()
    tracker.phase = "optim"
    method.opt.step()
    tracker.phase = "zero_grad"
    method.opt.zero_grad()


def measure(name: str, mode: str, cfg: bench.BenchConfig, mesh, base) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = bench.make_batches(cfg, cfg.warmup + 1, rank, world)
    gc.collect()
    before = live_storages()
    method = bench.build_method(name, base, mode, cfg, mesh)
    for i in range(cfg.warmup):
        dist.barrier()
        method.step(batches[i])
    tracker = TimelineTracker(classifier(method))
    tracker.track_new(before)
    before = None
    tracker._note("start")
    dist.barrier()
    with tracker:
        phased_step(method, batches[cfg.warmup], tracker)
    result = {"peak": tracker.peak, "phases": tracker.phase_peaks, "events": tracker.events,
              "top": local_peaks(tracker.timeline, TOP_PEAKS)}
    del method, tracker
    gc.collect()
    return result


TOP_PEAKS = 8


def local_peaks(timeline: list[tuple], n: int) -> list[tuple]:
    """The ``n`` highest local maxima of the timeline (each the highest point between two drops
    of at least 1 MiB), highest first: (event, bytes, phase, op, where)."""
    peaks, best = [], None
    for i, (nbytes, phase, op, where) in enumerate(timeline, 1):
        if best is None or nbytes > best[1]:
            best = (i, nbytes, phase, op, where)
        if best is not None and best[1] - nbytes >= MIB:  # dropped: the maximum so far was a peak
            peaks.append(best)
            best = (i, nbytes, phase, op, where)
    if best is not None:
        peaks.append(best)
    return sorted(peaks, key=lambda p: -p[1])[:n]


def format_report(name: str, mode: str, res: dict, top: int) -> str:
    lines = [f"== {mode} {name}: peak {res['peak'] / MIB:.1f} MiB ({res['events']} ops/resizes) =="]
    lines.append("  highest local peaks (event, MiB, phase, op, where):")
    for event, nbytes, phase, op, where in res["top"]:
        lines.append(f"    {event:>6} {nbytes / MIB:7.1f}  {phase:<9} {op:<32} {where}")
    for phase, info in res["phases"].items():
        lines.append(f"  {phase:<11} max {info['bytes'] / MIB:7.1f} MiB at event {info['event']}: "
                     f"{info['op']} in {info['where']}")
        items = sorted(info["live"].items(), key=lambda kv: -kv[1])
        shown, rest = items[:top], items[top:]
        for label, nbytes in shown:
            lines.append(f"      {nbytes / MIB:7.1f}  {label}")
        if rest:
            lines.append(f"      {sum(b for _, b in rest) / MIB:7.1f}  ({len(rest)} more kinds)")
    return "\n".join(lines)


def _measure_and_report(cfg: bench.BenchConfig, args) -> None:
    """Every rank measures each method of each mode in turn; rank 0 prints."""
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    if rank == 0:
        print(f"world {world}{' (fake: memory only)' if args.fake_world else ''}, batch {cfg.batch} "
              f"in {cfg.micro} micro-batch(es)", flush=True)
    for mode in cfg.dtypes:
        torch.manual_seed(cfg.seed)
        base = Llama(bench.model_config(cfg))
        for name in cfg.methods:
            release_library_caches()
            res = measure(name, mode, cfg, mesh, base)
            if rank == 0:
                print(format_report(name, mode, res, args.top), flush=True)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=("fp32", "bf16", "both"), default="fp32")
    parser.add_argument("--methods", default="ours,fsdp2,flat")
    parser.add_argument("--top", type=int, default=12, help="categories listed per phase peak")
    for flag, default in (("layers", 6), ("dim", 512), ("heads", 8), ("hidden", 1536), ("vocab", 8192),
                          ("seq", 128), ("batch", 4), ("warmup", 1), ("micro", 1)):
        parser.add_argument(f"--{flag}", type=int, default=default)
    parser.add_argument("--fake-world", type=int, default=0,
                        help="rank 0 of a fake world of this size (collectives do nothing: memory only); "
                             "default: world 2 on gloo")
    parser.add_argument("--strategy", choices=bench.STRATEGIES, default="optim_grads_params")
    parser.add_argument("--model", choices=tuple(bench.MODELS), default="llama",
                        help="what gets fully_shard: " + "; ".join(f"{k}: {v}" for k, v in bench.MODELS.items()))
    args = parser.parse_args(argv)
    cfg = bench.BenchConfig(
        dtypes=("fp32", "bf16") if args.dtype == "both" else (args.dtype,), vocab=args.vocab, dim=args.dim,
        layers=args.layers, heads=args.heads, hidden=args.hidden, seq=args.seq, batch=args.batch,
        micro=args.micro, warmup=args.warmup, model=args.model, strategy=args.strategy, data="random",
        methods=tuple(m.strip() for m in args.methods.split(",") if m.strip()),
    )
    bench.check_config(cfg)
    if "c10d" in cfg.methods:
        parser.error("--methods: 'c10d' (bench_fsdp's communication replay) trains no model; leave it out here")
    if args.batch % args.micro:
        parser.error(f"--micro ({args.micro}) must divide --batch ({args.batch})")
    if args.fake_world:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.fake_world)
        try:
            _measure_and_report(cfg, args)
        finally:
            dist.destroy_process_group()
    else:
        launch.spawn(2, _measure_and_report, cfg, args)


if __name__ == "__main__":
    main()
