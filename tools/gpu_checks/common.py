"""What every gpu_check section shares: the run's device and sizes, the Llama and its text batches,
the training loop, full weights, the comparisons, and the :class:`Context` that runs one row.

Why these sizes and this data: agreement between two trainings means something only when the
training itself is sane. On random tokens at lr 1e-3 the old bench configuration diverged above
ln(vocab) on an H200 and amplified CUDA's nondeterminism; here the model learns byte-level text
(``tools/text_data.py``, the demo's data) at the demo's lr, and every training row checks that its
loss fell. On CUDA the model is big enough for real GEMM, attention and NCCL kernels while the
whole tool stays within about 4 minutes; on CPU (``--cpu``) it is tiny.

Tolerances (:data:`TOLERANCES`, printed in the table next to each figure). The figure is max|dW|,
the largest elementwise difference of the trained weights, held to a tolerance where the two
trainings compute the same numbers up to rounding. AdamW's first updates are about ``lr`` per
element whatever the gradient's size, so an element whose gradient is nearly zero can move ``lr``
one way in one run and the other way in another: mixed precision against fp32 differs by a few
``lr``, and a max|dW| tolerance that loose could not tell a bug from rounding. Those comparisons
are held to ``rel dW`` instead: per tensor, ``|W_a - W_b| / |W_b - W_0|`` (2-norms), the worst
tensor's, which a wrong update of any one tensor pushes to about 1. When a max|dW| check fails,
the row also shows how many elements exceed the tolerance and the rel dW: a handful of elements
with a small rel dW is nondeterminism amplified by Adam, many is a bug.
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import json
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch

from tools.gpu_checks.rows import FSDP2, PLAIN, Row

# The model and batch of each kind of run: vocab 256 (bytes), lr as the demo's.
SIZES = {
    "cpu": dict(dim=64, layers=2, heads=4, hidden=128, seq=32, batch=8),
    "cuda": dict(dim=512, layers=4, heads=8, hidden=1408, seq=256, batch=16),
}
STEPS, LR, WEIGHT_DECAY = 4, 3e-3, 0.1
# (device, precision) -> {reference: (metric, tolerance)}. fp32 at world 1 computes the same
# numbers as the plain model (c10d over one rank is a copy); CUDA kernels may round differently for
# another memory layout, so CUDA gets some room, and deterministic algorithms (see deterministic()).
_FP32, _BF16 = ("max|dW|", 1e-5), ("rel dW", 0.3)
_NORMS = {  # relative difference of each step's gradient norm: fp32 / bf16 against fp32 / same precision
    "cpu": ({"norm plain": 1e-5, "norm fsdp2": 1e-6}, {"norm plain": 0.05, "norm fsdp2": 1e-6}),
    "cuda": ({"norm plain": 1e-4, "norm fsdp2": 1e-5}, {"norm plain": 0.05, "norm fsdp2": 1e-4}),
}
TOLERANCES = {
    ("cpu", "fp32"): {"plain": _FP32, "fsdp2": ("max|dW|", 1e-6), **_NORMS["cpu"][0]},
    ("cpu", "bf16"): {"plain": _BF16, "fsdp2": ("max|dW|", 1e-6), **_NORMS["cpu"][1]},
    ("cpu", "compiled"): {"plain": _FP32, "fsdp2": ("max|dW|", 1e-6), **_NORMS["cpu"][0]},
    ("cpu", "fp32 w>1"): {"plain": ("max|dW|", 5e-5), "fsdp2": ("max|dW|", 1e-6), **_NORMS["cpu"][0]},
    ("cpu", "bf16 w>1"): {"plain": _BF16, "fsdp2": ("max|dW|", 1e-6), **_NORMS["cpu"][1]},
    ("cuda", "fp32"): {"plain": ("max|dW|", 1e-4), "fsdp2": _FP32, **_NORMS["cuda"][0]},
    ("cuda", "bf16"): {"plain": _BF16, "fsdp2": ("max|dW|", 1e-4), **_NORMS["cuda"][1]},
    ("cuda", "compiled"): {"plain": ("rel dW", 0.2), "fsdp2": ("max|dW|", 1e-4), **_NORMS["cuda"][0]},
    ("cuda", "fp32 w>1"): {"plain": ("max|dW|", 1e-4), "fsdp2": _FP32, **_NORMS["cuda"][0]},
    ("cuda", "bf16 w>1"): {"plain": _BF16, "fsdp2": ("max|dW|", 1e-4), **_NORMS["cuda"][1]},
}


@dataclass
class Setup:
    """One run: ``device`` is ``"cuda"`` or ``"cpu"``; the sizes follow it."""

    device: str
    steps: int = STEPS
    lr: float = LR
    sizes: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.device not in SIZES:
            raise ValueError(f"device must be one of {sorted(SIZES)}, got {self.device!r}")
        self.sizes = {**SIZES[self.device], **self.sizes}

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cuda", 0) if self.cuda else torch.device("cpu")

    def tolerance(self, precision: str) -> dict:
        return TOLERANCES[(self.device, precision)]

    def llama_config(self):
        from tests.models.llama import LlamaConfig

        s = self.sizes
        return LlamaConfig(vocab_size=256, dim=s["dim"], n_layers=s["layers"], n_heads=s["heads"],
                           hidden_dim=s["hidden"], max_seq_len=s["seq"])

    def describe(self) -> str:
        s = self.sizes
        return (f"Llama dim {s['dim']} x {s['layers']} layers, {s['heads']} heads, SwiGLU {s['hidden']}, vocab 256 "
                f"(bytes of text); global batch {s['batch']} x {s['seq']}; {self.steps} AdamW steps at lr {self.lr:g}")


def base_model(setup: Setup, seed: int = 0) -> torch.nn.Module:
    """The Llama every method of a row starts from (on the CPU: copies are moved by the caller)."""
    from tests.models.llama import Llama

    torch.manual_seed(seed)
    return Llama(setup.llama_config())


_TEXT: list = []  # the ByteText, read once per process


def text_batches(setup: Setup, n: Optional[int] = None) -> list[torch.Tensor]:
    """The global batches ``[batch, seq + 1]`` of steps ``0..n-1``, on the run's device."""
    from tools.text_data import ByteText

    if not _TEXT:
        _TEXT.append(ByteText(max_bytes=1 << 20))
    s = setup.sizes
    return [_TEXT[0].batch(k, s["batch"], s["seq"]).to(setup.torch_device) for k in range(n or setup.steps)]


def adamw(setup: Setup) -> Callable[[torch.nn.Module], torch.optim.Optimizer]:
    """AdamW over a model's parameters; ``foreach=False``: the same per-tensor kernels for plain
    tensors, DTensors and fsdp's flat-layout subclasses, so layouts do not change the rounding."""
    return lambda model: torch.optim.AdamW(model.parameters(), lr=setup.lr, weight_decay=WEIGHT_DECAY, foreach=False)


def grad_norm(model: torch.nn.Module) -> float:
    """The 2-norm of all gradients, from their full tensors (``param.main_grad`` where BF16 main
    grads leave ``.grad`` empty), in float64: independent of the library's own clipping code."""
    total = 0.0
    for p in model.parameters():
        g = p.grad if p.grad is not None else getattr(p, "main_grad", None)
        if g is not None:
            total += float(plain_tensor(g).double().square().sum())
    return math.sqrt(total)


class Clipping:
    """An optimizer that clips the gradients to ``max_norm`` through ``clip`` before each step and
    records, per step, the norm ``clip`` returned and the gradients' float64 norm before and after
    (:func:`grad_norm`: independent of either library's clipping)."""

    def __init__(self, model: torch.nn.Module, opt, clip: Callable[[float], torch.Tensor], max_norm: float) -> None:
        self.model, self.opt, self.clip, self.max_norm = model, opt, clip, max_norm
        self.norms: list[float] = []
        self.before: list[float] = []
        self.after: list[float] = []

    def step(self) -> None:
        self.before.append(grad_norm(self.model))
        self.norms.append(float(self.clip(self.max_norm)))
        self.after.append(grad_norm(self.model))
        self.opt.step()

    def zero_grad(self) -> None:
        self.opt.zero_grad()


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, batches: list[torch.Tensor], *, micro: int = 1,
          rank: int = 0, world: int = 1, norms: Optional[list] = None,
          finalize: Optional[Callable[[], object]] = None) -> list[float]:
    """This rank's slice of each global batch, ``micro`` micro-batches a step (each loss / micro);
    returns this rank's loss per step. ``norms``: gets each step's :func:`grad_norm` (a
    collective on sharded models: every rank must ask). ``finalize``: called after the last
    backward of each step (``finalize_backward`` under manual backward finalization)."""
    from tests.models.llama import loss_fn

    losses = []
    for tokens in batches:
        per = tokens.shape[0] // world
        tokens = tokens[rank * per:(rank + 1) * per]
        total = torch.zeros((), device=tokens.device)
        for part in tokens.chunk(micro):
            loss = loss_fn(model(part[:, :-1]), part) / micro
            loss.backward()
            total += loss.detach()
        if finalize is not None:
            finalize()
        if norms is not None:
            norms.append(grad_norm(model))
        opt.step()
        opt.zero_grad()
        losses.append(float(total))
    return losses


_WRAPPERS = ("_orig_mod.", "_checkpoint_wrapped_module.")


def plain_tensor(t: torch.Tensor) -> torch.Tensor:
    """A parameter as a full plain fp32 tensor: a DTensor gathered, a weight subclass unwrapped."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    t = t.detach()
    while type(t) is not torch.Tensor and hasattr(t, "_data"):  # Float8RowwiseWeight
        t = t._data
    return t.float().cpu().clone()


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter by name (without compile's and checkpoint_wrapper's prefixes), full, fp32, on the CPU."""
    out = {}
    for name, p in model.named_parameters():
        for w in _WRAPPERS:
            name = name.replace(w, "")
        out[name] = plain_tensor(p)
    return out


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if a.keys() != b.keys():
        raise KeyError(f"the two models' parameters differ: {sorted(a.keys() ^ b.keys())}")
    return max(float((a[k] - b[k]).abs().max()) if a[k].numel() else 0.0 for k in a)


def rel_update(a: dict, b: dict, start: dict) -> float:
    """The worst tensor's ``|a - b| / |b - start|``: how far ``a``'s update is from ``b``'s,
    relative to ``b``'s (inf where ``b`` did not move but ``a`` did)."""
    worst = 0.0
    for k in b:
        num, den = float((a[k] - b[k]).double().norm()), float((b[k] - start[k]).double().norm())
        worst = max(worst, num / den if den > 0 else (0.0 if num == 0 else float("inf")))
    return worst


def over(a: dict, b: dict, tol: float) -> str:
    """How many elements differ by more than ``tol``, of how many."""
    n = sum(int(((a[k] - b[k]).abs() > tol).sum()) for k in a)
    return f"{n} of {sum(t.numel() for t in a.values())}"


@dataclass
class Trained:
    """What a training run leaves to compare: full weights, losses and gradient norms per step."""

    state: dict
    losses: list
    norms: list


def norm_diff(a: list, b: list) -> float:
    """The largest relative difference of two runs' gradient norms over their steps."""
    if len(a) != len(b) or not b:
        return float("inf")
    return max(abs(x - y) / y if y > 0 else float("inf") for x, y in zip(a, b))


def compare(row: Row, setup: Setup, precision: str, got: Trained, plain: Optional[Trained],
            fsdp2: Optional[Trained], start: dict) -> None:
    """The checks of a training row: ``got`` against the plain model and against FSDP2 (each
    where given) with the run's tolerances for ``precision``: the weights (max|dW| always
    reported) and the gradient norms of every step (Adam's update does not change when every
    gradient is scaled alike, so a wrong gradient scale shows only there)."""
    tolerances = setup.tolerance(precision)
    for key, name, ref in (("plain", PLAIN, plain), ("fsdp2", FSDP2, fsdp2)):
        if ref is None:
            continue
        metric, tol = tolerances[key]
        diff, rel = max_diff(got.state, ref.state), rel_update(got.state, ref.state, start)
        if metric == "max|dW|":
            if not row.check(name, diff, tol, metric=metric).ok:
                row.figures[f"over {tol:g} {name}"] = over(got.state, ref.state, tol)
                row.figures[f"rel dW {name}"] = rel
        else:
            row.figures[f"max|dW| {name}"] = diff
            row.check(name, rel, tol, metric=metric)
        if got.norms or ref.norms:
            row.check(f"grad norms {name}", norm_diff(got.norms, ref.norms), tolerances["norm " + key], metric="rel")


def loss_checks(row: Row, runs: dict[str, Any]) -> None:
    """Record each method's first and last loss (``runs``: name -> :class:`Trained` or losses);
    the training is sane only if every one fell (a check counting those whose last loss is below
    their first)."""
    losses = {name: r.losses if isinstance(r, Trained) else r for name, r in runs.items()}
    for name, values in losses.items():
        row.losses[name] = [values[0], values[-1]]
    fell = sum(1 for values in losses.values() if values[-1] < values[0])
    row.check("losses fell", fell, len(losses), op="==")


@contextlib.contextmanager
def world_one(setup: Setup) -> Iterator[Any]:
    """A default process group of one rank in this process (NCCL on cuda:0, gloo on the CPU),
    yields its 1-D mesh; ends through dbuffer's teardown so no group outlives the section."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from dbuffer.teardown import shutdown

    if setup.cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if setup.cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh(setup.device, (1,))
    finally:
        shutdown(barrier=False)


def deterministic(setup: Setup) -> None:
    """On CUDA, deterministic kernels where torch has them (a warning, not an error, where it has
    none): comparisons of two trainings then see the library's differences, not atomics' order.
    ``CUBLAS_WORKSPACE_CONFIG`` must be set before CUDA starts (the driver sets it)."""
    if setup.cuda:
        torch.use_deterministic_algorithms(True, warn_only=True)
        warnings.filterwarnings("once")


class Context:
    """A section's run: which rows to run (``only``: fnmatch patterns or substrings of
    ``section/name``, comma separated) and where each finished row goes (one JSON line per row in
    ``rows_file``; a ``{"started": ...}`` line first, so the driver can name a row that crashed or
    hung the process)."""

    def __init__(self, setup: Setup, section: str, only: str = "", rows_file: Optional[str] = None) -> None:
        self.setup, self.section = setup, section
        self.patterns = [p for p in only.split(",") if p]
        self.rows_file = rows_file
        self.rows: list[Row] = []

    def wants(self, name: str) -> bool:
        return selected(f"{self.section}/{name}", self.patterns)

    def _write(self, obj: dict) -> None:
        if self.rows_file:
            with open(self.rows_file, "a") as f:
                f.write(json.dumps(obj) + "\n")

    def row(self, name: str, body: Callable[[Row], None]) -> Optional[Row]:
        """Run ``body(row)`` as row ``name`` if selected: it fills the row's checks; an exception
        becomes the row's error. Returns the row (None when not selected)."""
        if not self.wants(name):
            return None
        row = Row(self.section, name)
        self._write({"started": row.full_name})
        print(f"[gpu_check] {row.full_name} ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        try:
            body(row)
        except Exception as exc:  # noqa: BLE001 - every failure is a row's verdict, the others still run
            row.fail_with(exc)
        finally:
            if self.setup.cuda:
                with contextlib.suppress(Exception):
                    torch.cuda.synchronize()
        row.seconds = time.perf_counter() - start
        self.rows.append(row)
        self._write({"row": row.to_dict()})
        problems = "; ".join(row.problems())
        print(f"[gpu_check] {row.full_name} {row.verdict} in {row.seconds:.1f} s {problems}", file=sys.stderr, flush=True)
        if row.traceback:
            print(row.traceback, file=sys.stderr, flush=True)
        return row


def selected(full_name: str, patterns: list[str]) -> bool:
    """Whether ``full_name`` is selected by ``patterns`` (none: everything): an fnmatch pattern
    or a substring."""
    if not patterns:
        return True
    return any(fnmatch.fnmatchcase(full_name, p) or p in full_name for p in patterns)


def cuda_env() -> dict[str, str]:
    """The environment a CUDA section process starts with: cuBLAS's deterministic workspace."""
    return {**os.environ, "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG", ":4096:8")}


def move(model: torch.nn.Module, setup: Setup) -> torch.nn.Module:
    """A copy of ``model`` on the run's device (``.to`` only when something is elsewhere: a
    model with tensor-subclass weights is built from a copy already there, see :func:`float8`)."""
    model = copy.deepcopy(model)
    if any(t.device != setup.torch_device for t in list(model.parameters()) + list(model.buffers())):
        model = model.to(setup.torch_device)
    return model


def float8(model: torch.nn.Module, setup: Setup) -> torch.nn.Module:
    """``model`` with Float8RowwiseWeight linear weights (tests/models/float8_weight.py), made on
    the run's device (no ``.to`` of a module holding tensor subclasses)."""
    from tests.models.float8_weight import float8_weights

    return float8_weights(move(model, setup))
