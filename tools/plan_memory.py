"""Memory planner: per-rank bytes of a ``fully_shard`` run, measured on a fake world and checked
against the closed form.

Run from the repository root::

    python3 tools/plan_memory.py --model llama3-70b --world 1024 --strategy optim_grads_params \\
        --param-dtype bf16 --main-grads-dtype fp32 --optimizer adamw [--rank R] [--json]
    python3 tools/plan_memory.py --model llama3-70b --world 1024 --tp 8 [--dp-replicate 2]
    python3 tools/plan_memory.py --model llama3-70b --world 1024 --dp-replicate 8 --outer-dp-sharding-strategy optim

or from Python, with a preset name or any callable that builds a module (it is called under
``torch.device("meta")``, so a plain constructor will do)::

    from tools.plan_memory import plan
    print(plan("mixtral-8x7b", world=256, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)).format())

Why measure rather than only compute: the bytes a rank holds depend on the row-atomic layout
(padding), on which buffers alias each other (the model weights *are* the main weights when the
dtypes match; ``no_shard``'s unsharded weights are its model weights) and on which buffers the
strategy keeps. So the planner runs the real thing: it joins torch's fake process group as rank
``rank`` of ``world`` (real shapes, no communication), builds the model on meta,
calls ``fully_shard`` on each block and then the root exactly as a training script would, and
reads the bytes of the DBuffers every ``ParameterGroup`` holds. The closed form is computed
independently from the parameter shapes alone; the only legitimate difference between the two is
layout padding, so every category is checked as ``|measured - closed| <= allowance`` where the
allowance is the padding the layout puts into those buffers.

Categories (bytes on this rank):

* main weights: the weights the optimizer updates (sharded unless ``no_shard``).
* model weights: the compute-dtype copy of the main shard; 0 when it aliases the main weights,
  and 0 with ``MixedPrecisionPolicy(persistent_param_shard=False)`` (``--lean-param-shard``),
  which casts the shard into a temporary before each gather instead (one cast per gather; the
  temporary, 1/world of a unit, is not counted). ``format()`` prints that trade-off.
* unsharded weights: the full compute weights ``optim``/``optim_grads`` keep between steps
  (``no_shard`` uses its model weights, ZeRO-3 gathers them per use: both 0 here).
* main grads: the reduced-gradient buffer (sharded for ``optim_grads*``), counted in full: it
  holds its storage at least from a step's first reduction to the optimizer step.
* grad copies: when the main-grads dtype differs from the main dtype, ``param.grad`` is a cast
  copy of this rank's rows of ``param.main_grad`` in the main dtype (what the optimizer reads).
  0 with ``fsdp.FlatAdamW`` & co. (``--flat-optimizer``: ``flat_optimizer=True``), which upcast
  one parameter's local piece at a time (that workspace, like the kernels' temporaries, is not
  counted).
* optimizer state: closed form, because torch optimizers allocate lazily: AdamW/Adam keep two
  tensors per parameter, SGD with momentum one, each like the parameter's local piece (this rank's
  rows, no padding), in the main dtype. The per-parameter ``step`` scalars are not counted.
* unsharded working set (ZeRO-3 only; the other strategies keep them, see above): full compute
  weights gathered per use.
* reduce working set (every strategy): the full ``grad_in`` buffers (reduce dtype) gradients
  accumulate in before their reduction.

Working sets are peaks over a training step, so they depend on fsdp's schedule (prefetching, how
many reductions stay in flight), which the planner measures rather than assumes: it runs three
forward/backward passes of a tiny probe model sharded with the same strategy on the same world and
records, whenever a buffer gets its storage back, which units hold gathered weights and
``grad_in`` at once. The probe is
shaped like a decoder LM (the root's own weights used first and last, blocks in registration
order); each moment "root + k units" is then priced with the root's and the k largest other units'
buffers of the real model, and the largest is the peak. With fsdp as of this writing: gathered
root + 2 units (the root stays gathered from its forward to the end of backward, plus the unit
computing and the one prefetched); reducing root + 1 or 2 units (the root's ``grad_in`` lives
through the whole backward: its first gradient, ``lm_head``'s, comes first and the embedding's
last). Not counted: the small sharded temporaries of a reduction whose reduce dtype differs from
the main-grads dtype (1/world of a unit each).

The total adds every category: a conservative estimate of the peak of the buffers fsdp manages
(the working sets peak in backward, the optimizer state and grad copies matter at the step; both
are added). Not counted:
activations, autograd and kernel temporaries, allocator fragmentation, communication workspaces.
Padding is reported separately ("of which"): bytes of the persistent buffers that hold no tensor
element, on this rank and on average over the ranks (the last ranks hold the most).

N-D meshes (``--tp T``, ``--dp-replicate R``; ``dp_shard = world / (T * R)``): the planner builds
the mesh ``(dp_replicate, dp_shard, tp)`` (size-1 axes left out) on the fake group, applies the
Llama TP plan of :mod:`tools.tp_plan` with torch's own ``parallelize_module`` on the ``tp``
sub-mesh (torchtitan's: column-parallel q/k/v/gate/up/w1/w3 and ``lm_head``, row-parallel
o/down/w2 and ``embed_tokens``, both split on the vocabulary; RMSNorm weights and Mixtral's router
replicated, plain tensors), then shards every block and the root on the dp axes (HSDP when
``R > 1``), as README "FSDP x TP / EP" does. DTensors work on meta under the fake group: nothing
is communicated or allocated. The closed form counts each parameter's TP piece (this rank's
``torch.chunk(weight, T, dim)`` piece for the split ones, the whole weight for the replicated
ones) and shards that over ``dp_shard``; replicas (``R``) hold copies, so they do not divide
anything. The TP parameters live in fsdp's chunked groups (``torch.chunk`` pieces over dp,
fsdp/group/layouts.py), whose padding (uneven pieces) is the allowance. Not counted with TP: those
groups' shard-major gather target, which under ZeRO-3 holds one more copy of a unit's gathered
weights from a gather's start to its copy into the parameters (the schedule probe has no TP groups,
so it does not see it); and the schedule is the 1-D probe's (fsdp schedules TP units the same way).

HFSDP (``--outer-dp-sharding-strategy optim`` with ``--dp-replicate R``, no TP; see
:mod:`fsdp.compose.outer_shard`): main weights, main grads, ``.grad`` copies and optimizer state are
sharded over ``R * dp_shard`` ranks instead of ``dp_shard``; the model weights are the
``dp_shard``-sharded compute copy (kept even when its dtype is the main one: it is the replicate
all-gather's result) plus, when the dtypes differ, the ``1/(R * dp_shard)`` cast piece that
all-gather reads.

Where the buffers live: by default on a ``meta`` mesh. ``fully_shard`` builds the very same
DBuffers (layouts, dtypes, placements, aliases, released storage), but nothing is allocated or
written, so any model plans in seconds on a laptop. Real storage is available (``device="cpu"``)
and gives the same figures for models that fit, but it cannot plan big ones: the ZeRO-0..2
strategies keep full replicated buffers (70B ``no_shard``: 282 GB of main weights per rank),
the fake group's all-gather writes its whole output, ``ParameterGroup`` zero-fills the full
gather and ``grad_in`` buffers before releasing them, and a sharded module is never freed (its
gradient hooks hold it in a cycle through autograd), so memory piles up across plans.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Optional, Union

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

from fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402
from fsdp.group.policy import STRATEGIES, Strategy, parse_strategy  # noqa: E402
from dbuffer import DBuffer, OwnedLayout, RaggedLayout  # noqa: E402
from fsdp.group.layout_choice import LAYOUT_KINDS, layout_policy  # noqa: E402
from dbuffer.teardown import shutdown  # noqa: E402
from tools.tp_plan import MeshShape, local_shape, tp_dim, tp_plan  # noqa: E402

__all__ = ["Bytes", "Plan", "PRESETS", "OPTIMIZER_STATES", "plan", "main"]

GiB = 2**30
MiB = 2**20

# Tensors of optimizer state per parameter, each like the parameter (torch's defaults).
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 1, "none": 0}  # sgd: with momentum

# A moment of the schedule: (whether the root holds its buffer, how many other units hold theirs).
Moment = tuple[bool, int]
WORKING_SETS = {"unsharded_working_set": "unsharded", "reduce_working_set": "grad_in"}  # category: buffer


def _working_buffer(g, attr: str):
    """The group's working-set buffer ``attr`` (``grad_in`` lives on its gradient reducer,
    ``unsharded`` on its weights part), or None."""
    owner = g.grads if attr == "grad_in" else g.weights
    return getattr(owner, attr, None) if owner is not None else None


# ----------------------------------------------------------------------------- presets


@dataclass(frozen=True)
class Config:
    """A decoder-only transformer's shapes (Hugging Face Llama / Mixtral names and order)."""

    name: str
    vocab: int
    dim: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    experts: int = 0  # 0: dense SwiGLU MLP; else per-expert SwiGLU weights and a router


class Weight(nn.Module):
    """A module holding one uninitialised ``weight`` (a Linear, Embedding or norm, shapes only):
    the planner never runs forward or init, and ``nn.Embedding``'s init on meta alone would
    import torch._dynamo (2 s)."""

    def __init__(self, *shape: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape))


class Linear(nn.Linear):
    """An ``nn.Linear`` without bias or init: shapes only, but an ``nn.Linear``, so that torch's
    ``parallelize_module`` (which dispatches on the module type) can apply a TP plan to it."""

    def reset_parameters(self) -> None:
        pass


class Embedding(nn.Embedding):
    """An ``nn.Embedding`` without init (its init on meta would import torch._dynamo, 2 s)."""

    def reset_parameters(self) -> None:
        pass


def _linear(fan_in: int, fan_out: int) -> Linear:
    return Linear(fan_in, fan_out, bias=False)  # weight [out, in]


class Attention(nn.Module):
    """Grouped-query attention projections: ``kv_heads`` key/value heads shared by the queries."""

    def __init__(self, c: Config) -> None:
        super().__init__()
        head_dim = c.dim // c.heads
        self.q_proj = _linear(c.dim, c.heads * head_dim)
        self.k_proj = _linear(c.dim, c.kv_heads * head_dim)
        self.v_proj = _linear(c.dim, c.kv_heads * head_dim)
        self.o_proj = _linear(c.heads * head_dim, c.dim)


class MLP(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = _linear(c.dim, c.ffn), _linear(c.dim, c.ffn)
        self.down_proj = _linear(c.ffn, c.dim)


class Expert(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = _linear(c.dim, c.ffn), _linear(c.ffn, c.dim), _linear(c.dim, c.ffn)


class SparseMoE(nn.Module):
    """A router and separate per-expert weights (stacking experts would make a row an expert)."""

    def __init__(self, c: Config) -> None:
        super().__init__()
        self.gate = _linear(c.dim, c.experts)
        self.experts = nn.ModuleList(Expert(c) for _ in range(c.experts))


class DecoderLayer(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.self_attn = Attention(c)
        if c.experts:
            self.block_sparse_moe = SparseMoE(c)
        else:
            self.mlp = MLP(c)
        self.input_layernorm = Weight(c.dim)
        self.post_attention_layernorm = Weight(c.dim)


class CausalLM(nn.Module):
    """Shapes only: the planner never runs forward, so none is defined."""

    def __init__(self, c: Config) -> None:
        super().__init__()
        self.embed_tokens = Embedding(c.vocab, c.dim)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.layers))
        self.norm = Weight(c.dim)
        self.lm_head = _linear(c.dim, c.vocab)  # untied


CONFIGS = {
    "llama3-8b": Config("Llama-3-8B", 128256, 4096, 32, 32, 8, 14336),
    "llama3-70b": Config("Llama-3-70B", 128256, 8192, 80, 64, 8, 28672),
    "mixtral-8x7b": Config("Mixtral-8x7B", 32000, 4096, 32, 32, 8, 14336, experts=8),
}
PRESETS: dict[str, Callable[[], nn.Module]] = {key: (lambda c=c: CausalLM(c)) for key, c in CONFIGS.items()}


def _resolve_model(model: Union[str, Callable[[], nn.Module]]) -> tuple[str, Callable[[], nn.Module]]:
    if isinstance(model, str):
        key = model.lower().replace("-", "").replace("_", "").replace(".", "")
        for name, c in CONFIGS.items():
            if key in (name.replace("-", ""), c.name.lower().replace("-", "")):
                return c.name, PRESETS[name]
        raise ValueError(f"unknown model preset {model!r}; use one of {', '.join(CONFIGS)} or pass a callable")
    if not callable(model):
        raise TypeError(f"model must be a preset name or a callable building an nn.Module, got {type(model).__name__}")
    return getattr(model, "__name__", type(model).__name__), model


# ----------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Bytes:
    """One category on this rank: measured, closed form, and the padding that may separate them."""

    measured: int
    closed: int
    allowance: int

    @property
    def ok(self) -> bool:
        return abs(self.measured - self.closed) <= self.allowance

    def __add__(self, other: "Bytes") -> "Bytes":
        return Bytes(self.measured + other.measured, self.closed + other.closed, self.allowance + other.allowance)


CATEGORIES = (
    ("main_weights", "main weights"),
    ("model_weights", "model weights"),
    ("unsharded_weights", "unsharded weights"),
    ("main_grads", "main grads"),
    ("grad_copies", "grad copies (.grad)"),
    ("optimizer_state", "optimizer state"),
    ("unsharded_working_set", "unsharded working set"),
    ("reduce_working_set", "reduce working set"),
)
PERSISTENT = ("main_weights", "model_weights", "unsharded_weights", "main_grads", "grad_copies", "optimizer_state")


@dataclass
class Plan:
    """Per-rank bytes of one ``fully_shard`` configuration (see the module docstring)."""

    model: str
    world: int
    rank: int
    strategy: str
    dtypes: str  # e.g. "main fp32, model bf16, main grads fp32, reduce bf16"
    optimizer: str  # "adamw", ... with " (flat)" for fsdp.optim's flat optimizers
    params: int  # parameter elements (tied ones once)
    units: int
    layout_padding: int  # elements of all units' layouts that hold no tensor
    main_weights: Bytes
    model_weights: Bytes
    unsharded_weights: Bytes
    main_grads: Bytes
    grad_copies: Bytes
    optimizer_state: Bytes
    unsharded_working_set: Bytes
    reduce_working_set: Bytes
    padding: int  # bytes of this rank's persistent buffers holding no tensor element
    padding_mean: int  # the same, averaged over the ranks
    device: str  # where the shards were built: "meta" (nothing allocated) or a real device
    released_between_uses: bool  # every working-set buffer held no storage after fully_shard
    peak_moments: dict[str, Moment]  # per working set: the moment of its peak (root held, other units)
    seconds: dict[str, float] = field(default_factory=dict)
    param_shard_bytes: int = 0  # closed form of a persistent model shard, whether kept or cast per gather
    persistent_param_shard: bool = True
    grad_copy_bytes: int = 0  # closed form of the FP32 .grad copies, whether made or not (flat)
    mesh: dict[str, int] = field(default_factory=dict)  # {"dp_replicate": R, "dp_shard": S, "tp": T}
    local_params: int = 0  # parameter elements on this rank's TP piece (= params without TP)
    outer_dp_sharding_strategy: str = "no_shard"  # "optim": HFSDP (fsdp.compose.outer_shard)
    layouts: dict[str, int] = field(default_factory=dict)  # groups per layout kind: {"ragged": 80, ...}
    layout_policy: str = "chunk"  # fsdp.group.layout_choice's kind the groups were built under

    def categories(self) -> dict[str, Bytes]:
        return {key: getattr(self, key) for key, _ in CATEGORIES}

    @property
    def persistent(self) -> Bytes:
        return sum((getattr(self, k) for k in PERSISTENT), Bytes(0, 0, 0))

    @property
    def total(self) -> Bytes:
        return sum(self.categories().values(), Bytes(0, 0, 0))

    @property
    def ok(self) -> bool:
        return all(b.ok for b in self.categories().values()) and self.total.ok

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["total"] = dataclasses.asdict(self.total)
        out["ok"] = self.ok
        return out

    def format(self) -> str:
        shape = MeshShape(**self.mesh) if self.mesh else MeshShape(1, self.world, 1)
        mesh = "" if shape.is_1d else f" = {shape.describe()}"
        if self.outer_dp_sharding_strategy == "optim":
            mesh += " (HFSDP: optimizer sharded over dp_replicate x dp_shard)"
        tp = "" if shape.tp == 1 else f" ({self.local_params:,} on this TP rank, Llama TP plan)"
        head = (
            f"{self.model}: {self.params:,} parameters{tp} in {self.units} units, world {self.world}{mesh}, rank {self.rank}, "
            f"{self.strategy} (ZeRO-{list(STRATEGIES).index(self.strategy)}), {self.dtypes}, {self.optimizer}"
            + ("" if self.device == "meta" else f", shards on {self.device}")
        )
        rows = [head, f"{'category':<24}{'GiB/rank':>11}{'closed GiB':>12}{'diff':>11}{'allowance':>12}  check"]
        for key, label in CATEGORIES:
            rows.append(_row(label, getattr(self, key)))
        rows.append(_row("total", self.total))
        share = self.layout_padding / max(1, (self.local_params or self.params) + self.layout_padding)
        rows.append(
            f"{'of which padding':<24}{self.padding / GiB:>11.4f}  on this rank; {self.padding_mean / GiB:.4f} GiB "
            f"on average (the layouts pad {100 * share:.4f}%)"
        )
        kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(self.layouts.items()))
        rows.append(f"layouts ({self.layout_policy}): {kinds} group(s)")
        for key, (root, k) in self.peak_moments.items():
            held = ("the root" if root else "") + (" + " if root and k else "") + (f"{k} other unit(s)" if k else "")
            rows.append(f"{key.replace('_', ' ')}: peak while {held or 'nothing'} held it (schedule of the probe)")
        rows.extend(self.trade_offs())
        verdict = "measured = closed form within padding" if self.ok else "MISMATCH beyond padding"
        times = ", ".join(f"{k} {v:.2f} s" for k, v in self.seconds.items())
        rows.append(f"{verdict}; {times}")
        return "\n".join(rows)


    def trade_offs(self) -> list[str]:
        """The memory knobs that apply to this configuration and what each costs or saves."""
        rows = []
        if self.param_shard_bytes:
            size = f"{self.param_shard_bytes / GiB:.4f} GiB/rank"
            if self.persistent_param_shard:
                rows.append(
                    f"param shard: persistent (fast; {size}); persistent_param_shard=False (--lean-param-shard) "
                    f"saves it for one cast of the shard before every gather"
                )
            else:
                rows.append(
                    f"param shard: cast before every gather (lean; saves {size}); the default persistent shard "
                    f"is cast once per optimizer step instead"
                )
        if self.grad_copy_bytes:
            size = f"{self.grad_copy_bytes / GiB:.4f} GiB/rank"
            if self.optimizer.endswith("(flat)"):
                rows.append(f"grad copies: none, the flat optimizer upcasts by chunks (torch.optim would cast {size})")
            else:
                rows.append(f"grad copies: torch.optim needs FP32 .grad ({size}); fsdp.FlatAdamW (--flat-optimizer) saves it")
        return rows


def _row(label: str, b: Bytes) -> str:
    diff = b.measured - b.closed
    rel = f"{100 * diff / b.closed:+.4f}%" if b.closed else ("0" if not diff else "inf")
    return (
        f"{label:<24}{b.measured / GiB:>11.4f}{b.closed / GiB:>12.4f}{rel:>11}"
        f"{b.allowance / MiB:>9.2f} MiB  {'ok' if b.ok else 'FAIL'}"
    )


# ----------------------------------------------------------------------------- planning


def plan(
    model: Union[str, Callable[[], nn.Module]],
    world: int,
    rank: int = 0,
    *,
    strategy: Union[str, Strategy] = "optim_grads_params",
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    optimizer: str = "adamw",
    blocks: Optional[Callable[[nn.Module], Iterable[nn.Module]]] = None,
    device: str = "meta",
    flat_optimizer: bool = False,
    tp: int = 1,
    dp_replicate: int = 1,
    outer_dp_sharding_strategy: str = "no_shard",
    layout: str = "chunk",
) -> Plan:
    """Shard ``model`` (a preset name or a builder) as rank ``rank`` of ``world`` and measure.

    ``blocks(module)`` picks the units sharded before the root (default: the children of the
    first ``nn.ModuleList``, e.g. ``model.layers``). ``device``: where the shards live, ``"meta"``
    (nothing allocated) or a real device type such as ``"cpu"`` (see the module docstring).
    ``flat_optimizer``: the step is fsdp.optim's (no FP32 ``.grad`` copies).

    ``tp`` > 1 or ``dp_replicate`` > 1: an N-D mesh ``(dp_replicate, dp_shard, tp)`` of ``world``
    ranks (size-1 axes left out; ``dp_shard = world / (tp * dp_replicate)``). With ``tp`` > 1 the
    model gets :mod:`tools.tp_plan`'s Llama plan from torch's ``parallelize_module`` on the tp
    sub-mesh (on meta), then ``fully_shard`` on the dp axes (HSDP with ``dp_replicate`` > 1), as in
    README "FSDP x TP / EP". The closed form divides the TP-split weights by ``tp`` (this TP rank's
    ``torch.chunk`` piece) and the replicated ones not, then shards both over ``dp_shard``.

    ``outer_dp_sharding_strategy="optim"`` (with ``dp_replicate`` > 1, ``tp`` 1): HFSDP, passed to
    ``fully_shard``; the optimizer's buffers are then sharded over ``dp_replicate * dp_shard``.
    ``layout``: :func:`fsdp.group.layout_choice.layout_policy`'s kind for the default groups:
    ``"chunk"`` (fully_shard's default, FSDP2's torch.chunk pieces), ``"auto"`` (row-atomic unless
    it pads more than 0.1%: ragged for Llama-3-70B at 1024 ranks), ``"row"`` or ``"ragged"``; the
    plan counts the groups of each kind (``layouts``).

    Uses the default process group if one exists (it must have this world size and rank, e.g.
    ``tests.harness.run_ranks(..., backend="fake")``); otherwise joins a fake one for the duration
    of the call.
    """
    name, build = _resolve_model(model)
    strategy = parse_strategy(strategy)
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be an fsdp.MixedPrecisionPolicy, got {type(mp_policy).__name__}")
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZER_STATES)}")
    if not isinstance(world, int) or world < 1 or not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"need an int world >= 1 and 0 <= rank < world, got world={world!r}, rank={rank!r}")
    shape = MeshShape.of(world, tp, dp_replicate)
    outer = outer_dp_sharding_strategy == "optim"
    if outer and (shape.dp_replicate < 2 or shape.tp > 1):
        raise ValueError(
            f"outer_dp_sharding_strategy='optim' (HFSDP) needs dp_replicate > 1 and tp = 1, got dp_replicate="
            f"{shape.dp_replicate}, tp={shape.tp}; fsdp shards the optimizer over the replicate axis of an HSDP mesh"
        )
    seconds: dict[str, float] = {}
    with _timed(seconds, "process group"):
        created = _join(world, rank)
    try:
        with _timed(seconds, "build on meta"), torch.device("meta"):
            root = build()
        if not isinstance(root, nn.Module):
            raise TypeError(f"the model builder returned {type(root).__name__}, not an nn.Module")
        units = list(blocks(root) if blocks is not None else _default_blocks(root))
        with _timed(seconds, "schedule probe"):
            schedule = _schedule(strategy, world)
        local_numel = _tp_local_numel(root, shape, rank)
        closed = _closed_form(
            root, units, shape.dp_shard, strategy, mp_policy, OPTIMIZER_STATES[optimizer], schedule, local_numel,
            optim_world=shape.dp_shard * shape.dp_replicate if outer else shape.dp_shard,
        )
        grad_copy_bytes = closed.bytes["grad_copies"]
        if flat_optimizer:
            closed.bytes["grad_copies"] = 0
        with _timed(seconds, "fully_shard"), layout_policy(layout):
            mesh = _mesh(device, shape, root)
            kw = dict(mp_policy=mp_policy, sharding_strategy=strategy, outer_dp_sharding_strategy=outer_dp_sharding_strategy)
            for unit in units:
                fully_shard(unit, mesh=mesh, **kw)
            fully_shard(root, mesh=mesh, **kw)
        with _timed(seconds, "measure"):
            states = [u._fsdp_state for u in units] + [root._fsdp_state]
            measured = _measure(states, OPTIMIZER_STATES[optimizer], schedule, flat_optimizer)
    finally:
        if created:  # a fake group owns no threads: no need to collect garbage to see it freed
            shutdown(collect=False)
    cats = {key: Bytes(measured.bytes[key], closed.bytes[key], measured.allowance[key]) for key, _ in CATEGORIES}
    return Plan(
        model=name, world=world, rank=rank, strategy=strategy.name, dtypes=_describe(mp_policy),
        optimizer=optimizer + (" (flat)" if flat_optimizer else ""),
        params=closed.params, units=closed.units, layout_padding=measured.layout_padding, **cats,
        padding=measured.padding, padding_mean=measured.padding_mean, device=device,
        released_between_uses=measured.released, peak_moments=measured.peak_moments, seconds=seconds,
        param_shard_bytes=closed.param_shard_bytes, persistent_param_shard=mp_policy.persistent_param_shard,
        grad_copy_bytes=grad_copy_bytes, mesh=shape.to_dict(), local_params=closed.local_params,
        outer_dp_sharding_strategy=outer_dp_sharding_strategy,
        layouts=measured.layouts, layout_policy=layout,
    )


def _mesh(device: str, shape: MeshShape, root: nn.Module):
    """The data-parallel mesh ``fully_shard`` gets; with ``tp`` > 1, after applying the TP plan to
    ``root`` on the tp sub-mesh of the same N-D mesh."""
    if shape.is_1d:
        return init_device_mesh(device, (shape.world,))
    mesh = init_device_mesh(device, shape.sizes(), mesh_dim_names=shape.names())
    if shape.tp > 1:
        from torch.distributed.tensor.parallel import parallelize_module

        styles = tp_plan(root)
        if not styles:
            raise ValueError(
                "tp > 1 but the model has no module the Llama TP plan splits (q_proj, o_proj, gate_proj, ... see "
                "tools/tp_plan.py); name its modules that way or plan with tp=1"
            )
        parallelize_module(root, mesh["tp"], styles)
    dp = shape.dp_names()
    return mesh[dp[0]] if len(dp) == 1 else mesh[dp]


def _tp_local_numel(root: nn.Module, shape: MeshShape, rank: int) -> dict[int, int]:
    """id(parameter) -> elements of this rank's TP piece, from the plan and the shapes alone."""
    out = {}
    for fqn, p in root.named_parameters():
        piece = local_shape(tuple(p.shape), tp_dim(fqn), shape.tp, shape.tp_rank(rank))
        out[id(p)] = math.prod(piece)
    return out


def _default_blocks(root: nn.Module) -> list[nn.Module]:
    for m in root.modules():
        if isinstance(m, nn.ModuleList):
            return list(m)
    return []


def _join(world: int, rank: int) -> bool:
    """Use the default process group if it matches, else join a fake one; True if created."""
    if dist.is_initialized():
        have = (dist.get_world_size(), dist.get_rank())
        if have != (world, rank):
            raise ValueError(
                f"a process group of world {have[0]} (this rank {have[1]}) already exists; plan with "
                f"world={have[0]}, rank={have[1]} or destroy it first"
            )
        return False
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    return True


@contextlib.contextmanager
def _timed(seconds: dict[str, float], what: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        seconds[what] = time.perf_counter() - start


def _describe(p: MixedPrecisionPolicy) -> str:
    d = _dtypes(p, torch.float32)
    return f"main {_short(d[0])}, model {_short(d[1])}, main grads {_short(d[2])}, reduce {_short(d[3])}"


def _short(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}.get(
        dtype, str(dtype).removeprefix("torch.")
    )


# ----------------------------------------------------------------------------- closed form


@dataclass
class _Closed:
    params: int
    units: int
    bytes: dict[str, int]
    param_shard_bytes: int = 0  # a persistent model shard's bytes, whether the policy keeps it
    local_params: int = 0  # elements of this rank's TP pieces


def _dtypes(p: MixedPrecisionPolicy, built: torch.dtype) -> tuple[torch.dtype, torch.dtype, torch.dtype, torch.dtype]:
    """(main, model, main grads, reduce) of a parameter built as ``built``, from the policy's
    documented defaults (written out here so the closed form does not ask fsdp)."""
    if not built.is_floating_point:
        return built, built, built, built
    main = p.main_params_dtype or built
    model = p.param_dtype or main
    return main, model, p.main_grads_dtype or main, p.reduce_dtype or model


def _closed_form(
    root: nn.Module,
    blocks: list[nn.Module],
    world: int,
    s: Strategy,
    policy: MixedPrecisionPolicy,
    states: int,
    schedule: dict[str, frozenset[Moment]],
    local_numel: dict[int, int],
    optim_world: Optional[int] = None,
) -> _Closed:
    """Bytes per rank from the parameter shapes alone: a parameter counts its TP piece's
    elements (``local_numel``: all of them without TP); sharded totals are ``ceil(bytes / world)``
    (``world``: the dp shard axis's size). ``optim_world``: the ranks the main weights, main
    grads and optimizer state are sharded over (HFSDP: replicate x shard; default ``world``);
    when it differs from ``world`` the model weights are the separate ``world``-sharded copy
    plus the cast piece of the optimizer's shard."""
    optim_world = world if optim_world is None else optim_world
    outer = optim_world != world
    groups = [_unique(b.parameters()) for b in blocks]
    in_blocks = {id(p) for g in groups for p in g}
    root_params = [p for p in _unique(root.parameters()) if id(p) not in in_blocks]

    def total(params: list[nn.Parameter], which: int, trainable_only: bool = False) -> int:
        return sum(
            local_numel[id(p)] * _dtypes(policy, p.dtype)[which].itemsize
            for p in params
            if p.requires_grad or not trainable_only
        )

    def per_rank(nbytes: int, sharded: bool, over: int = optim_world) -> int:
        return -(-nbytes // over) if sharded else nbytes

    every = root_params + [p for g in groups for p in g]
    trainable = [p for p in every if p.requires_grad]
    cast = [p for p in every if _dtypes(policy, p.dtype)[1] != _dtypes(policy, p.dtype)[0]]
    regrad = [p for p in trainable if _dtypes(policy, p.dtype)[2] != _dtypes(policy, p.dtype)[0]]
    main_trainable = per_rank(total(trainable, 0), s.shard_optim)
    param_shard = per_rank(total(cast, 1), s.shard_optim)
    # no_shard's model weights are its full ones; HFSDP's model shard is always kept
    lean = s.shard_optim and not policy.persistent_param_shard and not outer
    model_weights = 0 if lean else param_shard
    if outer:  # the shard-axis copy every gather reads, and the cast piece gathered into it
        model_weights = per_rank(total(every, 1), True, world) + param_shard
    out = {
        "main_weights": per_rank(total(every, 0), s.shard_optim),
        "model_weights": model_weights,
        "unsharded_weights": total(every, 1) if s.shard_optim and not s.shard_params else 0,
        "main_grads": per_rank(total(trainable, 2), s.shard_grads),
        "grad_copies": per_rank(total(regrad, 0), s.shard_optim),
        "optimizer_state": states * main_trainable,
    }
    for key, which, trainable_only in (("unsharded_working_set", 1, False), ("reduce_working_set", 3, True)):
        sizes = [(total(g, which, trainable_only), 0) for g in groups] + [(total(root_params, which, trainable_only), 0)]
        out[key] = _peak(sizes, schedule[key])[0][0]
    return _Closed(
        sum(p.numel() for p in every), len(groups) + 1, out, param_shard if s.shard_optim and not outer else 0,
        sum(local_numel[id(p)] for p in every),
    )


def _peak(units: list[tuple[int, int]], moments: frozenset[Moment]) -> tuple[tuple[int, int], Moment]:
    """((bytes, padding), moment) of the costliest moment: ``units`` are (bytes, padding) per
    unit, the root last; a moment holds the root's buffer (or not) and the k largest others'."""
    others = sorted(units[:-1], reverse=True)
    priced = []
    for root, k in moments:
        held = [units[-1]] * root + others[:k]
        priced.append(((sum(b for b, _ in held), sum(p for _, p in held)), (root, k)))
    return max(priced, default=((0, 0), (False, 0)))


def _unique(params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {}
    for p in params:
        seen.setdefault(id(p), p)
    return list(seen.values())


# ----------------------------------------------------------------------------- measurement


@dataclass
class _Measured:
    bytes: dict[str, int]
    allowance: dict[str, int]
    padding: int = 0
    padding_mean: int = 0
    layout_padding: int = 0
    released: bool = True
    peak_moments: dict[str, Moment] = field(default_factory=dict)
    layouts: dict[str, int] = field(default_factory=dict)


def _measure(units: list, states: int, schedule: dict[str, frozenset[Moment]], flat: bool = False) -> _Measured:
    """Read the DBuffers of every unit's groups (each storage once: aliases are skipped).
    ``units``: the FSDP states, the root's last."""
    m = _Measured({k: 0 for k, _ in CATEGORIES}, {k: 0 for k, _ in CATEGORIES})
    gathered: list[tuple[int, int]] = []  # (bytes, padding bytes) per unit, the root last
    reducing: list[tuple[int, int]] = []
    for state in units:
        unit_gather, unit_reduce = (0, 0), (0, 0)
        for g in state.groups:
            m.layout_padding += _padding_numel(g, g.main)
            kind = _layout_kind(g)
            m.layouts[kind] = m.layouts.get(kind, 0) + 1
            _persistent(m, "main_weights", g, g.main)
            w = g.weights
            if w.model is not g.main and not w.lean_model:
                _persistent(m, "model_weights", g, w.model)
            if w.cast_main is not None:  # HFSDP: the cast optimizer shard
                _persistent(m, "model_weights", g, w.cast_main)
            if w.unsharded is not w.model and not g.strategy.shard_params:
                _persistent(m, "unsharded_weights", g, w.unsharded)
            if g.strategy.shard_params:
                unit_gather = _plus(unit_gather, _transient(m, g, w.unsharded))
            if not g.requires_grad:
                continue
            _persistent(m, "main_grads", g, g.grads.main_grad)
            unit_reduce = _plus(unit_reduce, _transient(m, g, g.grads.grad_in))
            # Like the parameter's local piece, in the main dtype: this rank's rows, no padding.
            data = _data_bytes(g, g.main)
            slack = max(_nbytes(g.main) - data, _padding_share(g, g.main))
            m.bytes["optimizer_state"] += states * data
            m.allowance["optimizer_state"] += states * slack
            if g.grads.main_grad.dtype != g.main.dtype and not flat:
                m.bytes["grad_copies"] += data
                m.allowance["grad_copies"] += slack
        gathered.append(unit_gather)
        reducing.append(unit_reduce)
    for key, sizes in (("unsharded_working_set", gathered), ("reduce_working_set", reducing)):
        (m.bytes[key], m.allowance[key]), moment = _peak(sizes, schedule[key])
        if m.bytes[key]:
            m.peak_moments[key] = moment
    return m


def _persistent(m: _Measured, key: str, g, buf) -> None:
    m.bytes[key] += _nbytes(buf)
    m.allowance[key] += _padding_share(g, buf)
    m.padding += _nbytes(buf) - _data_bytes(g, buf)
    m.padding_mean += _padding_share(g, buf)


def _transient(m: _Measured, g, buf) -> tuple[int, int]:
    """(bytes, padding bytes) of a full buffer that holds storage only while in use."""
    m.released &= buf.is_storage_released()
    return _nbytes(buf), _nbytes(buf) - _data_bytes(g, buf)


def _plus(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    return a[0] + b[0], a[1] + b[1]


def _nbytes(buf) -> int:
    """Bytes of this rank's local buffer while it holds storage (its shape stays when the storage
    is released between uses, so this is not the storage's current size)."""
    return buf.local_buffer.numel() * buf.local_buffer.element_size()


def _chunks(g, buf):
    """The ``torch.chunk`` layout of ``buf`` when it is one of a chunked group's flat shard-major
    buffers (TP parameters and ``shard_placement_fn``: fsdp/group/layouts.py), else None. Those hold one
    flat item, so their padding is the chunk layout's, not the flat item's (none)."""
    chunks = getattr(g.layout, "chunks", None)
    return None if chunks is None or buf is g.weights.unsharded else chunks


def _layout_kind(g) -> str:
    if getattr(g.layout, "chunks", None) is not None:
        return "torch.chunk"
    layout = g.main.layout
    if isinstance(layout, RaggedLayout):
        return "ragged"
    return "owned" if isinstance(layout, OwnedLayout) else "row-atomic"


def _padding_numel(g, buf) -> int:
    chunks = _chunks(g, buf)
    return buf.layout.padding_numel if chunks is None else chunks.padding_numel


def _data_bytes(g, buf) -> int:
    """Bytes of this rank's elements of every tensor in ``buf`` (from the layout: works while
    the storage is released; row ranges or, of a ragged layout, element ranges)."""
    chunks = _chunks(g, buf)
    if chunks is None:
        numel = sum(e1 - e0 for e0, e1 in (buf.local_elements(i) for i in range(len(buf))))
    elif buf.local_buffer.numel() == chunks.total_numel:  # replicated: every shard's pieces
        numel = chunks.data_numel
    else:  # sharded: this rank's torch.chunk pieces
        numel = sum(chunks.piece(k, g.layout.rank)[1] * it.inner for k, it in enumerate(chunks.items))
    return numel * buf.dtype.itemsize


def _padding_share(g, buf) -> int:
    """The layout's padding divided evenly over the shards, in bytes (rounded up). A sharded
    buffer holds at most this much more than ``ceil(data / shards)``."""
    return math.ceil(_padding_numel(g, buf) * buf.dtype.itemsize / buf.num_shards)


# ----------------------------------------------------------------------------- schedule probe

PROBE_BLOCKS = 6
_SCHEDULES: dict[str, dict[str, frozenset[Moment]]] = {}  # per strategy, for this process


class _ProbeLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4, 4))  # no RNG drawn: the caller's stream is kept

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


class _Probe(nn.Module):
    """Decoder-shaped: the root's own weights are used first and last, the blocks in between."""

    def __init__(self) -> None:
        super().__init__()
        self.first = _ProbeLinear()
        self.blocks = nn.ModuleList(_ProbeLinear() for _ in range(PROBE_BLOCKS))
        self.last = _ProbeLinear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x)
        for block in self.blocks:
            x = block(x)
        return self.last(x)


def _schedule(strategy: Strategy, world: int) -> dict[str, frozenset[Moment]]:
    """Moments at which each working set grows, measured on the probe (cached per strategy: the
    schedule does not depend on sizes, dtypes or the world size)."""
    if strategy.name not in _SCHEDULES:
        _SCHEDULES[strategy.name] = _run_probe(strategy, world)
    return _SCHEDULES[strategy.name]


def _run_probe(strategy: Strategy, world: int) -> dict[str, frozenset[Moment]]:
    """Three forward/backward passes of the probe (prefetching starts with the second), noting
    which units hold each working-set buffer whenever any DBuffer gets its storage back."""
    probe = _Probe()
    mesh = init_device_mesh("cpu", (world,))
    for block in probe.blocks:
        fully_shard(block, mesh=mesh, sharding_strategy=strategy)
    fully_shard(probe, mesh=mesh, sharding_strategy=strategy)
    units = [b._fsdp_state for b in probe.blocks] + [probe._fsdp_state]
    # Without ZeRO-3 the gathered weights are persistent (counted elsewhere), not a working set.
    watched = {k: v for k, v in WORKING_SETS.items() if strategy.shard_params or v != "unsharded"}
    seen: dict[str, set[Moment]] = {key: set() for key in WORKING_SETS}

    def note() -> None:
        for key, attr in watched.items():
            held = [any(b is not None and not b.is_storage_released() for b in (_working_buffer(g, attr) for g in u.groups)) for u in units]
            seen[key].add((held[-1], sum(held[:-1])))

    reallocate = DBuffer.reallocate_storage

    def noting(buf: DBuffer) -> None:
        reallocate(buf)
        note()

    DBuffer.reallocate_storage = noting  # type: ignore[method-assign]
    try:
        for _ in range(3):
            probe(torch.ones(2, 4)).sum().backward()
            probe.zero_grad()
    finally:
        DBuffer.reallocate_storage = reallocate  # type: ignore[method-assign]
    return {key: frozenset(moments) for key, moments in seen.items()}


# ----------------------------------------------------------------------------- command line

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama3-70b", help=f"preset: {', '.join(CONFIGS)}")
    ap.add_argument("--world", type=int, default=1024, help="ranks in all (dp_replicate * dp_shard * tp)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size: the Llama TP plan of tools/tp_plan.py")
    ap.add_argument("--dp-replicate", type=int, default=1, help="HSDP replicas (dp_shard = world / (tp * this))")
    ap.add_argument(
        "--outer-dp-sharding-strategy", default="no_shard", choices=["no_shard", "optim"],
        help="optim: HFSDP, the optimizer also sharded over --dp-replicate (fsdp.compose.outer_shard)",
    )
    ap.add_argument("--rank", type=int, default=0, help="every rank allocates the same; the last ones hold the padding")
    ap.add_argument("--strategy", default="optim_grads_params", choices=list(STRATEGIES), help="ZeRO-0..3")
    ap.add_argument("--param-dtype", default="bf16", choices=list(DTYPES), help="model (compute) weights")
    ap.add_argument("--main-dtype", default="fp32", choices=list(DTYPES), help="main weights")
    ap.add_argument("--main-grads-dtype", default="fp32", choices=list(DTYPES))
    ap.add_argument("--reduce-dtype", default=None, choices=list(DTYPES), help="default: the param dtype")
    ap.add_argument("--optimizer", default="adamw", choices=list(OPTIMIZER_STATES))
    ap.add_argument("--lean-param-shard", action="store_true", help="persistent_param_shard=False: cast per gather")
    ap.add_argument("--flat-optimizer", action="store_true", help="fsdp.FlatAdamW & co.: no FP32 .grad copies")
    ap.add_argument("--layout", default="chunk", choices=list(LAYOUT_KINDS), help="default groups' layout (chunk: FSDP2's torch.chunk pieces; auto: row-atomic unless it pads > 0.1%%)")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = ap.parse_args(argv)
    policy = MixedPrecisionPolicy(
        param_dtype=DTYPES[args.param_dtype],
        main_params_dtype=DTYPES[args.main_dtype],
        main_grads_dtype=DTYPES[args.main_grads_dtype],
        reduce_dtype=DTYPES[args.reduce_dtype] if args.reduce_dtype else None,
        persistent_param_shard=not args.lean_param_shard,
    )
    start = time.perf_counter()
    result = plan(
        args.model, args.world, args.rank, strategy=args.strategy, mp_policy=policy, optimizer=args.optimizer,
        flat_optimizer=args.flat_optimizer, tp=args.tp, dp_replicate=args.dp_replicate, layout=args.layout,
        outer_dp_sharding_strategy=args.outer_dp_sharding_strategy,
    )
    result.seconds["plan total"] = time.perf_counter() - start
    print(json.dumps(result.to_dict(), indent=1) if args.json else result.format())
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
