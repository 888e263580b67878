"""Benchmark one Llama training step three ways: our ``fsdp.fully_shard``, torch FSDP2, and the
compute-only floor, interleaved in one run with a raw-c10d reference (ours' communication alone).

    python3 tools/bench_fsdp.py                       # both modes, default model (~5.5 min on 2 cores)
    python3 tools/bench_fsdp.py --dtype fp32 --layers 2 --dim 128 --steps 4   # a quick look
    torchrun --nproc-per-node 2 tools/bench_fsdp.py --dtype fp32
    python3 tools/bench_fsdp.py --json out.json --plot out.png --profile ours

Model: ``tests.models.llama.Llama`` (defaults: vocab 8192, dim 512, 6 layers, 8 heads, SwiGLU hidden
1536), sequence 128, ``--batch`` 4 sequences per rank, on ``--world`` 2 gloo ranks over loopback,
one CPU thread per rank. Every rank builds the same model from the same seed; each method trains
its own copy of it on the same batches (real text: ``tools.text_data.ByteText``, or ``--data
random`` tokens), each rank on its own rows of the global batch.

Methods, each (but ``c10d``) running forward, loss, backward, ``AdamW.step()`` and ``zero_grad()``
every step:

* ``ours``: ``fsdp.fully_shard`` on every block, then on the root (``--strategy``, default
  ``optim_grads_params`` = ZeRO-3);
* ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` on every block, then on the root (always its
  default, ZeRO-3 with ``reshard_after_forward=True``; ``--strategy`` changes ours only);
* ``floor``: the plain model on every rank: the same local batch, no sharding, no communication;
* ``c10d``: raw c10d, no model: the c10d calls ``ours`` made in its last untimed step, replayed
  alone on preallocated tensors (:mod:`tools.comm_replay`); what the communication itself costs.
  Where the ranks' compute threads fill every core, no data-parallel step can take less CPU time
  than ``floor`` + ``c10d``: the table prints that bound next to the ours/floor target;
* ``flat``: ``ours`` with ``fsdp.FlatAdamW`` (the step over the flat shards, :mod:`fsdp.optim`)
  and, in bf16, ``main_grads_dtype=bf16`` (no FP32 gradient copy at the step);
* ``lean`` (only with ``--methods``): ``flat`` with ``persistent_param_shard=False`` (no BF16
  shard kept between steps; the shard is cast before each gather);
* ``row`` (only with ``--methods``): ``ours`` built under ``fsdp.layout_policy("auto")``,
  Megatron's flat row-atomic layout: no copy out of each gather or into each reduction, which
  the default (FSDP2's ``torch.chunk`` pieces, as ``ours`` runs) makes.

The table prints peak memory and step time of each variant against FSDP2 and ``ours``.

Precision (``--dtype``; ``both`` runs fp32, then bf16):

* fp32: no policy for either library (fp32 weights, grads and reductions); the floor is fp32.
* bf16: FSDP2 ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (fp32 sharded
  weights, AdamW and gradients); ours ``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32, main_params_dtype=fp32, main_grads_dtype=fp32)`` (the same four dtypes). The
  floor is a bf16 *copy* of the model (``.to(bfloat16)``: weights, gradients and AdamW states in
  bf16), so its forward and backward run exactly the bf16 arithmetic the two sharded methods run;
  autocast would instead keep the residual stream in fp32 (the embedding is not autocast) and
  recast every weight in every step, i.e. a different and slower computation.

On a CPU without native bf16 arithmetic (AVX2 only) bf16 matmuls run at 1-10 GFLOP/s against
~80 for fp32 (the table prints this machine's figures), so a bf16 step of the default model takes
~30 s and is almost all matmul: the default times one bf16 step per method (``--steps`` for more)
and fp32 six; the whole default run is dominated by the nine bf16 steps (~5 of its ~5.5 minutes).

Measurements:

* Warmup and measurement: each method in turn (the others idle) is built, runs ``--warmup``
  untimed steps, then one untimed *measured* step with the memory tracker and the collective
  counter below installed.
* Time: then the methods run round-robin, one step each, in an order rotated every step (the
  same on every rank), so drift of the machine hits them alike. A step is timed from the moment
  the last rank enters it (after a barrier) to the moment the last rank leaves it; the table
  shows the median over ``--steps`` timed steps and the targets use the ratio of medians. As
  checks against a shared, noisy machine it also gives the median of the per-round ratios, the
  ratio of the fastest steps, and the CPU time of a step (``time.process_time`` of the rank's
  process, all its threads, gloo's included; mean over ranks, median over steps).
* Memory: a storage-level tracker of our own (``StorageTracker``: a ``TorchDispatchMode`` plus a
  hook on ``UntypedStorage.resize_``; ``torch.distributed._tools.mem_tracker`` is not used).
  When the measured step starts it holds every storage that a Python-visible tensor of the
  process holds and that did not exist before the method was built (found through ``gc``:
  parameters, gradients, optimizer state, the library's own buffers and caches, e.g. dbuffer's
  collective scratch, which is released before each mode). During the step it adds every storage
  an operator reads or writes (DTensors count by their local tensors, c10d operators included),
  each once at its current size, and drops freed ones (weak references). The peak is the
  largest total after any operator or resize. Memory the c10d backend allocates inside a
  collective (gloo's staging buffers) is not a torch storage and is not seen.
* Communication: the ``torch.distributed`` collective and point-to-point functions are wrapped
  during the measured step only (``CommCounter``). ``calls`` counts every c10d call (isend and
  irecv each count one); ``ops`` counts collectives, with the isend/irecv calls of one
  point-to-point all-gather or reduce-scatter (``world - 1`` sends and receives posted together)
  counted as one op. ``sent`` is the bytes this rank must send for them with a bandwidth-optimal
  algorithm: all-gather ``(W-1) * input``, reduce-scatter and all-to-all ``(W-1)/W * input``,
  all-reduce ``2 (W-1)/W * tensor``, send the tensor; gloo's own algorithms may move more (its
  ``reduce_scatter_single`` runs as an all-reduce).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gc
import inspect
import json
import os
import socket
import statistics
import sys
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NoReturn, Optional

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

from tools import comm_replay  # noqa: E402

METHODS = ("ours", "fsdp2", "floor", "c10d", "flat")
# Variants of ours: "flat" = fsdp.FlatAdamW (the step over the flat shards) with BF16 main grads in
# bf16 mode; "lean" = flat + MixedPrecisionPolicy(persistent_param_shard=False) (no BF16 shard
# kept between steps); "row" = ours under layout_policy("auto"), Megatron's flat row-atomic layout
# (no copy out of each gather and into each reduction, which ours, on FSDP2's pieces, makes).
# Not run by default: "lean", "row".
VARIANTS = ("flat", "lean", "row")
ALL_METHODS = METHODS + ("lean", "row")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
# bf16 matmuls are very slow on a CPU without bf16 units (a bf16 step of the default model takes
# about 30 s on a 2-core AVX2 machine, an fp32 one about 1.3 s): time one bf16 step by default.
DEFAULT_STEPS = {"fp32": 6, "bf16": 1}
MIB = 1 << 20

# Targets from the issue: (name, what, limit); a ratio must be <= its limit.
TARGETS = {
    "fp32": [("step_ours_over_fsdp2", "step time ours/FSDP2", 0.80),
             ("peak_ours_over_fsdp2", "peak memory ours/FSDP2", 0.85),
             ("ops_ours_over_fsdp2", "collectives per step ours/FSDP2", 1.0)],
    "bf16": [("step_ours_over_fsdp2", "step time ours/FSDP2", 0.75),
             ("step_ours_over_floor", "step time ours/floor", 1.10),
             ("peak_ours_over_fsdp2", "peak memory ours/FSDP2", 0.85),
             ("peak_flat_over_fsdp2", "peak memory flat (FlatAdamW + BF16 main grads)/FSDP2", 0.77),
             ("ops_ours_over_fsdp2", "collectives per step ours/FSDP2", 1.0)],
}


@dataclass
class BenchConfig:
    """Everything one benchmark run needs; plain values, so it pickles to worker processes."""

    dtypes: tuple = ("fp32", "bf16")
    vocab: int = 8192
    dim: int = 512
    layers: int = 6
    heads: int = 8
    hidden: int = 1536
    seq: int = 128
    batch: int = 4  # sequences per rank
    steps: Optional[int] = None  # timed steps per method; None: DEFAULT_STEPS of the mode
    warmup: int = 1
    strategy: str = "optim_grads_params"
    data: str = "text"  # "text" (ByteText) or "random"
    foreach: Optional[bool] = None  # AdamW's foreach; None: torch's default
    lr: float = 1e-3
    seed: int = 0
    measure: bool = True  # the untimed measured step (memory + communication)
    methods: tuple = METHODS

    def steps_for(self, mode: str) -> int:
        return self.steps if self.steps is not None else DEFAULT_STEPS[mode]


# ----------------------------------------------------------------------------- memory


def _local_tensors(x: Any) -> list[torch.Tensor]:
    """Plain tensors behind ``x``: itself, or the inner tensors of a subclass (DTensor)."""
    if not isinstance(x, torch.Tensor):
        return []
    if type(x) is torch.Tensor or type(x) is torch.nn.Parameter or not hasattr(x, "__tensor_flatten__"):
        return [x]
    names, _ = x.__tensor_flatten__()
    out: list[torch.Tensor] = []
    for name in names:
        out.extend(_local_tensors(getattr(x, name)))
    return out


class StorageTracker(TorchDispatchMode):
    """Live bytes of the untyped storages a piece of work owns or touches, and their peak.

    Storages enter the account when :meth:`track` is given a tensor holding them or when an
    operator run under this mode reads or writes them; each is counted once, at its current size
    (refreshed whenever an operator touches it or ``UntypedStorage.resize_`` changes it), and
    leaves the account when it is freed (a weak reference). ``peak`` is the largest total seen
    after any operator or resize.
    """

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, list] = {}  # storage cdata -> [weakref, counted nbytes]
        self.current = 0
        self.peak = 0
        self._orig_resize = None

    def track(self, *objs: Any) -> None:
        """Count the storages of these tensors (any pytree of them) from now on."""
        self.track_storages(local.untyped_storage() for t in tree_flatten(list(objs))[0]
                            for local in _local_tensors(t))

    def track_storages(self, storages) -> None:
        for st in storages:
            self._account(st)
        self.peak = max(self.peak, self.current)

    def _account(self, st: torch.UntypedStorage) -> None:
        key = st._cdata
        entry = self._live.get(key)
        nbytes = st.nbytes()
        if entry is None:
            self._live[key] = [weakref.ref(st, self._make_release(key)), nbytes]
            self.current += nbytes
        elif entry[1] != nbytes:
            self.current += nbytes - entry[1]
            entry[1] = nbytes

    def _make_release(self, key: int) -> Callable:
        def release(_ref) -> None:
            entry = self._live.pop(key, None)
            if entry is not None:
                self.current -= entry[1]

        return release

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten((args, kwargs, out))[0]:
            if isinstance(t, torch.Tensor):
                for local in _local_tensors(t):
                    self._account(local.untyped_storage())
        if self.current > self.peak:
            self.peak = self.current
        return out

    def __enter__(self):
        tracker = self
        orig = self._orig_resize = torch.UntypedStorage.resize_

        def resize_(st, size):
            result = orig(st, size)
            tracker._account(st)
            tracker.peak = max(tracker.peak, tracker.current)
            return result

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._orig_resize
        return super().__exit__(*exc)


# ----------------------------------------------------------------------------- communication

_COLLECTIVES = {  # function -> (kind, how the sent bytes follow from (input bytes, W))
    "all_gather_single": ("all_gather", "input_tensor", lambda b, w: (w - 1) * b),
    "all_gather_into_tensor": ("all_gather", "input_tensor", lambda b, w: (w - 1) * b),
    "all_gather": ("all_gather", "tensor", lambda b, w: (w - 1) * b),
    "reduce_scatter_single": ("reduce_scatter", "input", lambda b, w: (w - 1) * b / w),
    "reduce_scatter_tensor": ("reduce_scatter", "input", lambda b, w: (w - 1) * b / w),
    "reduce_scatter": ("reduce_scatter", "input_list", lambda b, w: (w - 1) * b / w),
    "all_reduce": ("all_reduce", "tensor", lambda b, w: 2 * (w - 1) * b / w),
    "all_to_all_single": ("all_to_all", "input", lambda b, w: (w - 1) * b / w),
    "all_to_all": ("all_to_all", "input_tensor_list", lambda b, w: (w - 1) * b / w),
    "broadcast": ("broadcast", "tensor", lambda b, w: b),  # upper bound: what a relay sends
    "reduce": ("reduce", "tensor", lambda b, w: b),
    "barrier": ("barrier", None, lambda b, w: 0),
}
_P2P = {"isend": "send", "send": "send", "irecv": "recv", "recv": "recv"}


def _nbytes(x: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor))


class CommCounter:
    """Counts the c10d calls made through ``torch.distributed``'s functions while installed,
    attributed to ``self.label`` (calls made while it is None are not counted)."""

    def __init__(self) -> None:
        self.label: Optional[str] = None
        self.stats: dict[str, dict] = {}
        self._originals: dict[str, Callable] = {}
        self._depth = 0
        self._exchange: Optional[dict] = None  # the point-to-point op being posted
        self.trace: Optional[list] = None  # the calls being recorded (``recording``), for a replay

    def _stats(self) -> dict:
        return self.stats.setdefault(self.label, {"calls": 0, "ops": 0, "bytes_sent": 0.0, "by_kind": {}})

    def _count(self, kind: str, sent: float, new_op: bool) -> None:
        if self.label is None:  # only recording
            return
        s = self._stats()
        s["calls"] += 1
        s["bytes_sent"] += sent
        k = s["by_kind"].setdefault(kind, {"calls": 0, "bytes_sent": 0.0})
        k["calls"] += 1
        k["bytes_sent"] += sent
        if new_op:
            s["ops"] += 1

    def _on_collective(self, name: str, bound: inspect.BoundArguments) -> bool:
        kind, arg, sent_of = _COLLECTIVES[name]
        self._exchange = None
        group = bound.arguments.get("group")
        world = dist.get_world_size(group)
        size = _nbytes(bound.arguments.get(arg)) if arg else 0
        self._count(kind, float(sent_of(size, world)), new_op=True)
        return True

    def _on_p2p(self, name: str, bound: inspect.BoundArguments) -> bool:
        direction = _P2P[name]
        tensor = bound.arguments["tensor"]
        storage = tensor.untyped_storage()._cdata
        world = dist.get_world_size(bound.arguments.get("group"))
        ex = self._exchange
        joins = (
            ex is not None
            and ex[direction] < world - 1
            and (ex[direction + "_storage"] in (None, storage))
        )
        if not joins:
            ex = self._exchange = {"send": 0, "recv": 0, "send_storage": None, "recv_storage": None}
        ex[direction] += 1
        ex[direction + "_storage"] = storage
        if ex["send"] == ex["recv"] == world - 1:
            self._exchange = None  # complete: the next call starts a new op
        self._count(f"p2p_{direction}", float(_nbytes(tensor)) if direction == "send" else 0.0, new_op=not joins)
        return not joins

    def _wrap(self, name: str, fn: Callable, handler: Callable) -> Callable:
        sig = inspect.signature(fn)
        counter = self

        def wrapper(*args, **kwargs):
            if counter._depth == 0 and (counter.label is not None or counter.trace is not None):
                try:
                    bound = sig.bind(*args, **kwargs)
                except TypeError:  # a call torch itself will reject; let it
                    bound = None
                if bound is not None:
                    new_op = handler(name, bound)
                    if counter.trace is not None:
                        counter.trace.append(comm_replay.record(name, bound.arguments, new_op))
            counter._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                counter._depth -= 1

        wrapper.__wrapped__ = fn
        return wrapper

    def install(self) -> None:
        for name in list(_COLLECTIVES) + list(_P2P):
            fn = getattr(dist, name, None)
            if fn is None or name in self._originals:
                continue
            self._originals[name] = fn
            handler = self._on_p2p if name in _P2P else self._on_collective
            setattr(dist, name, self._wrap(name, fn, handler))

    def uninstall(self) -> None:
        for name, fn in self._originals.items():
            setattr(dist, name, fn)
        self._originals.clear()

    @contextlib.contextmanager
    def counting(self, label: str):
        self.label, self._exchange = label, None
        try:
            yield
        finally:
            self.label, self._exchange = None, None

    @contextlib.contextmanager
    def recording(self):
        """Record the calls made inside (``comm_replay.Call`` values); yields the list."""
        self.trace, self._exchange = [], None
        try:
            yield self.trace
        finally:
            self.trace, self._exchange = None, None


# ----------------------------------------------------------------------------- methods


def _policy_text(mode: str) -> dict[str, str]:
    if mode == "fp32":
        return {
            "ours": "no policy: main/model/main-grad/reduce all fp32",
            "fsdp2": "no policy: fp32 params, grads, reduce-scatter",
            "floor": "plain fp32 model, fp32 AdamW",
            "flat": "no policy (as ours)",
            "lean": "no policy (as ours; nothing to cast)",
            "row": "no policy (as ours), layout_policy('auto'): flat row-atomic layout",
            "c10d": _REPLAY_TEXT,
        }
    return {
        "ours": "param_dtype=bf16, main_params_dtype=fp32, main_grads_dtype=fp32, reduce_dtype=fp32",
        "fsdp2": "param_dtype=bf16, reduce_dtype=fp32 (sharded params, grads, AdamW fp32)",
        "floor": "bf16 copy of the model (.to(bfloat16)): bf16 weights, grads and AdamW states",
        "flat": "param_dtype=bf16, main_params_dtype=fp32, main_grads_dtype=bf16, reduce_dtype=fp32",
        "lean": "as flat, persistent_param_shard=False (cast the shard before each gather)",
        "row": "as ours, layout_policy('auto'): flat row-atomic layout",
        "c10d": _REPLAY_TEXT,
    }


_REPLAY_TEXT = "raw c10d: ours' c10d calls of one step replayed alone (no model, no framework)"


class ReplayMethod:
    """``c10d``: a step is :meth:`comm_replay.Replay.run`; its "loss" is 0 (there is no model)."""

    def __init__(self, trace: list) -> None:
        self.name, self.opt, self.replay = "c10d", None, comm_replay.Replay(trace)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        self.replay.run()
        return torch.zeros(())


class Method:
    """One way of training: a model, its optimizer and ``step(tokens) -> loss``."""

    def __init__(self, name: str, model: torch.nn.Module, cfg: BenchConfig, optimizer=torch.optim.AdamW) -> None:
        from tests.models.llama import loss_fn

        self.name, self.model, self.loss_fn = name, model, loss_fn
        self.opt = optimizer(model.parameters(), lr=cfg.lr, foreach=cfg.foreach)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        loss = self.loss_fn(self.model(tokens[:, :-1]), tokens)  # no name keeps the logits alive
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return loss.detach()


def build_method(name: str, base: torch.nn.Module, mode: str, cfg: BenchConfig, mesh) -> Method:
    model = copy.deepcopy(base)
    if name == "floor":
        if mode == "bf16":
            model = model.to(torch.bfloat16)
        return Method(name, model, cfg)
    if name in ("ours",) + VARIANTS:
        import fsdp

        policy = fsdp.MixedPrecisionPolicy()
        if mode == "bf16":
            policy = fsdp.MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32, main_params_dtype=torch.float32,
                main_grads_dtype=torch.float32 if name in ("ours", "row") else torch.bfloat16,
                persistent_param_shard=name != "lean",
            )
        kw = dict(mesh=mesh, mp_policy=policy, sharding_strategy=cfg.strategy)
        with fsdp.layout_policy("auto" if name == "row" else "chunk"):
            for block in model.layers:
                fsdp.fully_shard(block, **kw)
            fsdp.fully_shard(model, **kw)
        return Method(name, model, cfg, torch.optim.AdamW if name in ("ours", "row") else fsdp.FlatAdamW)
    if name == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy()
        if mode == "bf16":
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.layers:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return Method(name, model, cfg)
    raise ValueError(f"unknown method {name!r}; use one of {ALL_METHODS}")


def make_batches(cfg: BenchConfig, n: int, rank: int, world: int) -> list[torch.Tensor]:
    """This rank's ``[batch, seq + 1]`` tokens for steps ``0..n-1`` (the same for every method)."""
    if cfg.data == "text":
        from tools.text_data import ByteText

        data = ByteText(seed=cfg.seed)
        return [data.batch(s, cfg.batch * world, cfg.seq, rank=rank, world_size=world) for s in range(n)]
    if cfg.data == "random":
        out = []
        for s in range(n):
            gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + s)
            full = torch.randint(0, cfg.vocab, (cfg.batch * world, cfg.seq + 1), generator=gen)
            out.append(full[rank * cfg.batch:(rank + 1) * cfg.batch].clone())
        return out
    raise ValueError(f"data must be 'text' or 'random', got {cfg.data!r}")


def _model_config(cfg: BenchConfig):
    from tests.models.llama import LlamaConfig

    return LlamaConfig(vocab_size=cfg.vocab, dim=cfg.dim, n_layers=cfg.layers, n_heads=cfg.heads,
                       hidden_dim=cfg.hidden, max_seq_len=cfg.seq)


def _optimizer_impl(method: Method) -> str:
    from torch.optim.optimizer import _default_to_fused_or_foreach

    if method.opt is None:
        return "-"
    foreach = method.opt.defaults.get("foreach")
    if foreach is None:
        params = [p for g in method.opt.param_groups for p in g["params"]]
        _, foreach = _default_to_fused_or_foreach(params, False, False)
    return "foreach" if foreach else "for-loop"


# ----------------------------------------------------------------------------- one mode


def gemm_probe(modes: tuple = ("fp32", "bf16"), rows: int = 256, dim: int = 512, reps: int = 3) -> dict:
    """GFLOP/s of one-thread matmuls in the two layouts a linear layer uses: ``x @ W.T``
    (forward) and ``g @ W`` (backward, input gradient); best of ``reps``."""
    out: dict[str, dict[str, float]] = {}
    for name in modes:
        dtype = DTYPES[name]
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(rows, dim, generator=gen).to(dtype)
        w = torch.randn(dim, dim, generator=gen).to(dtype)
        res = {}
        for layout, fn in (("x@W.T", lambda: x @ w.t()), ("g@W", lambda: x @ w)):
            fn()
            best = min(_timed(fn) for _ in range(reps))
            res[layout] = 2 * rows * dim * dim / best / 1e9
        out[name] = res
    return out


def _timed(fn: Callable) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def live_storages() -> dict[int, torch.UntypedStorage]:
    """Every storage some Python-visible tensor of this process holds (DTensors by their local
    tensors), by storage identity."""
    out: dict[int, torch.UntypedStorage] = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor):  # not isinstance: no __class__ lookups on proxies
            for local in _local_tensors(obj):
                try:
                    st = local.untyped_storage()
                except (RuntimeError, NotImplementedError):  # a wrapper without storage
                    continue
                out.setdefault(st._cdata, st)
    return out


def _release_library_caches() -> None:
    """Start every mode from a clean slate: free dbuffer's idle collective scratch (public API)."""
    collectives = sys.modules.get("dbuffer.collectives")
    if collectives is not None:
        collectives.release_workspaces()


def run_mode(mode: str, cfg: BenchConfig, mesh, counter: CommCounter, progress: bool = False) -> dict:
    """Build the methods for ``mode`` (``fp32`` / ``bf16``), warm each up and measure its memory
    and communication in one untimed step (one method at a time), then time them interleaved.
    Every rank returns the same dict."""
    from tests.models.llama import Llama

    rank, world = dist.get_rank(), dist.get_world_size()
    started = time.perf_counter()
    _release_library_caches()
    steps = cfg.steps_for(mode)
    measured = 1 if cfg.measure else 0
    total = cfg.warmup + measured + steps
    batches = make_batches(cfg, total, rank, world)
    torch.manual_seed(cfg.seed)
    base = Llama(_model_config(cfg))
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
            gc.collect()
            tracker = StorageTracker()
            tracker.track_storages(st for key, st in live_storages().items() if key not in before)
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
    comm_by_rank = [None] * world
    dist.all_gather_object(comm_by_rank, {n: counter.stats.get(n) for n in names})
    counter.stats.clear()

    gemm = [None] * world
    dist.all_gather_object(gemm, gemm_probe(tuple(dict.fromkeys(("fp32", mode)))))  # all ranks at once
    result: dict = {
        "gemm_gflops": gemm[0],
        "policy": {n: _policy_text(mode)[n] for n in names},
        "optimizer": {n: f"{type(methods[n].opt).__name__} ({_optimizer_impl(methods[n])})"
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
        if measured:
            entry["start_bytes_by_rank"] = [int(r[j, 0].item()) for r in all_peaks]
            entry["peak_bytes_by_rank"] = [int(r[j, 1].item()) for r in all_peaks]
            entry["peak_bytes"] = max(entry["peak_bytes_by_rank"])
            comm = [c[name] or {"calls": 0, "ops": 0, "bytes_sent": 0.0, "by_kind": {}} for c in comm_by_rank]
            entry["comm_by_rank"] = comm
            entry["comm"] = {"ops": max(c["ops"] for c in comm), "calls": max(c["calls"] for c in comm),
                             "bytes_sent": max(c["bytes_sent"] for c in comm), "by_kind": comm[0]["by_kind"]}
        result["methods"][name] = entry
    result["ratios"] = _ratios(result["methods"])
    result["ratios"].update(_c10d_bound(result))
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


def _paired_ratios(names: list[str], stamps: torch.Tensor) -> dict:
    """Median over rounds of the ratio of the steps run in that round (robust to slow drift)."""
    out = {}
    times = stamps[..., 1] - stamps[..., 0]
    for a, b in (("ours", "fsdp2"), ("ours", "floor")):
        if a in names and b in names and times.shape[1]:
            per_round = (times[names.index(a)] / times[names.index(b)]).tolist()
            out[f"paired_step_{a}_over_{b}"] = statistics.median(per_round)
    return out


def _c10d_bound(result: dict) -> dict:
    """What the raw-c10d replay says about the floor comparison (nothing without "c10d" and
    "floor"). Where compute threads fill every core, each rank must spend the floor's CPU time
    and the communication's, so ``(floor + c10d) / floor`` of CPU time is the least ours/floor
    can be; with spare cores the communication can hide, and the bound is the longer of the two
    wall times over the floor's."""
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

    variants = {}
    for v in VARIANTS:
        if v in m:
            variants[f"step_{v}_over_fsdp2"] = ratio(v, "fsdp2", "median_ms")
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
        "calls_ours_over_fsdp2": comm_ratio("calls"),
        "sent_ours_over_fsdp2": comm_ratio("bytes_sent"),
    }


def run_benchmark(cfg: BenchConfig | dict, progress: bool = False) -> dict:
    """The benchmark on the current (initialised) process group; every rank returns the results."""
    from torch.distributed.device_mesh import init_device_mesh

    if isinstance(cfg, dict):
        cfg = BenchConfig(**cfg)
    _check_config(cfg)
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


def _check_config(cfg: BenchConfig) -> None:
    bad = [d for d in cfg.dtypes if d not in DTYPES]
    if bad or not cfg.dtypes:
        raise ValueError(f"dtypes must be a non-empty subset of {sorted(DTYPES)}, got {cfg.dtypes!r}")
    if cfg.strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {cfg.strategy!r}")
    if any(m not in ALL_METHODS for m in cfg.methods) or not cfg.methods:
        raise ValueError(f"methods must be a non-empty subset of {ALL_METHODS}, got {cfg.methods!r}")
    if cfg.warmup < 0 or (cfg.steps is not None and cfg.steps < 0):
        raise ValueError("warmup and steps must be >= 0")
    if "c10d" in cfg.methods:
        names = list(cfg.methods)
        if "ours" not in names or names.index("ours") > names.index("c10d"):
            raise ValueError("methods: 'c10d' replays the c10d calls of ours' last untimed step, so "
                             "'ours' must come before 'c10d' (or leave 'c10d' out)")
        if cfg.warmup + int(cfg.measure) == 0:
            raise ValueError("methods: 'c10d' needs one untimed step of ours to record: use --warmup >= 1 "
                             "or the measured step (leave out --no-measure), or leave 'c10d' out")


# ----------------------------------------------------------------------------- profiling


def profile_method(name: str, mode: str, cfg: BenchConfig, steps: int = 2, top: int = 25) -> str:
    """Profile ``steps`` steps of one method (after ``cfg.warmup + 1`` unprofiled ones) on rank 0:
    torch.profiler operator table, then cProfile of the Python side. Every rank must call it."""
    import cProfile
    import io
    import pstats

    from torch.distributed.device_mesh import init_device_mesh
    from tests.models.llama import Llama

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(cfg.seed)
    method = build_method(name, Llama(_model_config(cfg)), mode, cfg, mesh)
    warm = cfg.warmup + 1
    batches = make_batches(cfg, warm + 2 * steps, rank, world)
    for i in range(warm):
        method.step(batches[i])
    report = io.StringIO()
    dist.barrier()
    if rank == 0:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for i in range(steps):
                method.step(batches[warm + i])
        report.write(f"== torch.profiler, {name} {mode}, {steps} steps, rank 0: top {top} by self CPU ==\n")
        report.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top,
                                               max_name_column_width=50))
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


# ----------------------------------------------------------------------------- report


def _fmt(x: Optional[float], spec: str = ".2f", suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def format_table(report: dict) -> str:
    cfg = report["config"]
    lines = [
        f"Llama vocab {cfg['vocab']}, dim {cfg['dim']}, {cfg['layers']} layers, {cfg['heads']} heads, "
        f"hidden {cfg['hidden']}, seq {cfg['seq']}, batch {cfg['batch']}/rank; world {report['world']} "
        f"({report['backend']}, {report['threads_per_rank']} thread/rank), torch {report['torch']}",
        f"ours: fsdp.fully_shard per block + root, sharding_strategy={cfg['strategy']}; "
        f"fsdp2: torch fully_shard per block + root (its default ZeRO-3); floor: plain model, no communication",
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
        r = res["ratios"]
        lines.append(
            f"  ratios: step ours/fsdp2 {_fmt(r['step_ours_over_fsdp2'])}, ours/floor "
            f"{_fmt(r['step_ours_over_floor'])}, fsdp2/floor {_fmt(r['step_fsdp2_over_floor'])}; peak memory "
            f"ours/fsdp2 {_fmt(r['peak_ours_over_fsdp2'])}, ours/floor {_fmt(r['peak_ours_over_floor'])}; "
            f"collective ops ours/fsdp2 {_fmt(r['ops_ours_over_fsdp2'])} (c10d calls "
            f"{_fmt(r['calls_ours_over_fsdp2'])}, bytes sent {_fmt(r['sent_ours_over_fsdp2'])})"
        )
        for v in VARIANTS:
            if f"peak_{v}_over_fsdp2" in r:
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
            below = (f" (unreachable on this host: floor + raw c10d CPU is already {_fmt(bound)} of the floor)"
                     if bound is not None and bound > t["limit"] else "")
            lines.append(f"  target {t['what']} <= {t['limit']:.2f}: {_fmt(t['value'])} {verdict}{below}")
        lines.append(f"  ({res['wall_s']:.0f} s)")
    lines.append(f"\nwall time {report['wall_s']:.0f} s")
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


# ----------------------------------------------------------------------------- launcher


def _rank_main(rank: int, world: int, port: Optional[int], cfg: BenchConfig, args: argparse.Namespace) -> NoReturn:
    from dbuffer.teardown import shutdown

    torch.set_num_threads(1)
    if port is None:  # torchrun: rendezvous from the environment
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        _bench_and_report(cfg, args)
    except BaseException:
        shutdown(barrier=False)  # a peer may be gone; the error goes on to the launcher
        raise
    shutdown(0)  # barrier, free the group, exit 0 without finalising (see dbuffer.teardown)


def _bench_and_report(cfg: BenchConfig, args: argparse.Namespace) -> None:
    """Every rank benchmarks; rank 0 prints (and writes) the results."""
    report = run_benchmark(cfg, progress=not args.quiet)
    if dist.get_rank() == 0:
        print(format_table(report), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))
            print(f"results written to {args.json}")
        if args.plot:
            print(write_plot(report, args.plot))
    if args.profile:
        for mode in cfg.dtypes:
            text = profile_method(args.profile, mode, cfg, steps=args.profile_steps)
            if dist.get_rank() == 0:
                print(text, flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_args(argv: Optional[list[str]] = None) -> tuple[BenchConfig, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=("both", "fp32", "bf16"), default="both")
    parser.add_argument("--world", type=int, default=2, help="gloo ranks to launch (ignored under torchrun)")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"timed steps per method (default: {DEFAULT_STEPS['fp32']} fp32, "
                             f"{DEFAULT_STEPS['bf16']} bf16)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per method first (default 1)")
    parser.add_argument("--strategy", choices=STRATEGIES, default="optim_grads_params",
                        help="our sharding_strategy (default optim_grads_params = ZeRO-3)")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help=f"comma-separated subset of {','.join(ALL_METHODS)} (c10d: ours' communication replayed "
                             f"alone, after ours; flat: fsdp.FlatAdamW + BF16 main "
                             f"grads in bf16; lean: flat + persistent_param_shard=False; row: ours on Megatron's flat row-atomic layout)")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1536, help="SwiGLU hidden width")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--data", choices=("text", "random"), default="text")
    parser.add_argument("--foreach", choices=("default", "on", "off"), default="default",
                        help="AdamW foreach (default: torch's choice, the for-loop on CPU)")
    parser.add_argument("--no-measure", action="store_true", help="skip the memory/communication step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write all results to this JSON file")
    parser.add_argument("--plot", default=None, help="write a PNG bar chart here (needs matplotlib)")
    parser.add_argument("--profile", choices=[m for m in ALL_METHODS if m != "c10d"], default=None,
                        help="afterwards, profile this method on rank 0 (torch.profiler + cProfile)")
    parser.add_argument("--profile-steps", type=int, default=2)
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = parser.parse_args(argv)
    cfg = BenchConfig(
        dtypes=("fp32", "bf16") if args.dtype == "both" else (args.dtype,),
        vocab=args.vocab, dim=args.dim, layers=args.layers, heads=args.heads, hidden=args.hidden,
        seq=args.seq, batch=args.batch, steps=args.steps, warmup=args.warmup, strategy=args.strategy,
        data=args.data, foreach={"default": None, "on": True, "off": False}[args.foreach],
        seed=args.seed, measure=not args.no_measure,
        methods=tuple(m.strip() for m in args.methods.split(",") if m.strip()),
    )
    try:
        _check_config(cfg)
        _model_config(cfg)
    except ValueError as exc:
        parser.error(str(exc))
    if args.world < 1:
        parser.error("--world must be >= 1")
    return cfg, args


def main(argv: Optional[list[str]] = None) -> None:
    cfg, args = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # launched by torchrun
        _rank_main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), None, cfg, args)
        return
    import torch.multiprocessing as tmp

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # our own ranks talk over loopback
    tmp.start_processes(_rank_main, args=(args.world, _free_port(), cfg, args), nprocs=args.world,
                        start_method="spawn")


if __name__ == "__main__":
    main()
