"""The training step benchmarked several ways: bench_fsdp's methods (``ours``, ``fsdp2``, ``floor``,
the raw-c10d replay ``c10d``, and ours' variants ``row``, ``flat``, ``lean``), its models (the
Llama, with a head-only root, with float8 all-gather weights), its configuration and its batches. ``tools/bench_fsdp.py``'s docstring says what each method runs and how it is
measured; ``tools/mem_timeline.py`` builds the same methods to say where their memory peaks.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from tools.kit import comm_replay
from tools.kit.results import host_info
from tools.kit.timing import cpu_mark, phase_costs

# "ours" and "row" are the two layouts a user chooses between (FSDP2's torch.chunk pieces, the
# default, and Megatron's flat row-atomic layout): both run by default, so that choice is measured
# in every run.
METHODS = ("ours", "row", "fsdp2", "floor", "c10d", "flat")
# Variants of ours: "row" = ours under layout_policy("auto"), the flat row-atomic layout (no copy
# out of each gather and into each reduction, which ours, on FSDP2's pieces, makes); "flat" =
# fsdp.FlatAdamW (the step over the flat shards) with BF16 main grads in bf16 mode; "lean" = flat +
# MixedPrecisionPolicy(persistent_param_shard=False) (not run by default; the same as flat in
# these packed layouts, whose gathers keep no BF16 shard with either setting); "flat_bf16_state" =
# flat with FlatAdamW(state_dtype=torch.bfloat16), Megatron's precision-aware optimizer (BF16
# moments: half the optimizer state; not bit-equal to torch.optim, so not run by default).
VARIANTS = ("row", "flat", "lean", "flat_bf16_state")
ALL_METHODS = METHODS + ("lean", "flat_bf16_state")
FLAT_OPTIMIZER = ("flat", "lean", "flat_bf16_state")  # the variants that step with fsdp.FlatAdamW
# Which modules get fully_shard and what their weights are; the root is sharded last.
MODELS = {
    "llama": "Llama, fully_shard per block, then the root (embedding, final norm, lm_head)",
    "head_root": "Llama, the embedding its own unit, then every block, then the root, which holds only the "
                 "final norm and lm_head (torchtitan's and torchao's shape)",
    "float8": "Llama whose nn.Linear weights are Float8RowwiseWeight (tests/models/float8_weight.py: float8 "
              "all-gather, a tensor subclass), fully_shard as 'llama'",
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
# Timed steps per method by default. bf16 matmuls are very slow on a CPU without bf16 units (a
# bf16 step of the default model takes about 30 s on a 2-core AVX2 machine, an fp32 one about
# 1.3 s): there one bf16 step is timed; with native bf16 (AVX512-BF16 or AMX) as many as fp32.
DEFAULT_STEPS = {"fp32": 6, "bf16": 6}
SLOW_BF16_STEPS = 1


def native_bf16() -> bool:
    """Whether this CPU has bf16 dot-product units (AVX512-BF16 or AMX), from its flags."""
    flags = host_info()["flags"]
    return flags.get("avx512_bf16", False) or flags.get("amx_bf16", False)



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
    micro: int = 1  # micro-batches a step (gradient accumulation: each backward's loss / micro)
    steps: Optional[int] = None  # timed steps per method; None: DEFAULT_STEPS of the mode
    warmup: int = 1
    strategy: str = "optim_grads_params"
    data: str = "text"  # "text" (ByteText) or "random"
    foreach: Optional[bool] = None  # AdamW's foreach; None: torch's default
    lr: float = 1e-3
    seed: int = 0
    measure: bool = True  # the untimed measured step (memory + communication)
    methods: tuple = METHODS
    model: str = "llama"  # a key of MODELS

    def steps_for(self, mode: str) -> int:
        if self.steps is not None:
            return self.steps
        return SLOW_BF16_STEPS if mode == "bf16" and not native_bf16() else DEFAULT_STEPS[mode]


def default_methods(model: str) -> tuple:
    """The methods a run of ``model`` compares unless told otherwise."""
    return tuple(m for m in METHODS if not (model == "float8" and m in FLAT_OPTIMIZER))


def check_config(cfg: BenchConfig) -> None:
    bad = [d for d in cfg.dtypes if d not in DTYPES]
    if bad or not cfg.dtypes:
        raise ValueError(f"dtypes must be a non-empty subset of {sorted(DTYPES)}, got {cfg.dtypes!r}")
    if cfg.strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {cfg.strategy!r}")
    if any(m not in ALL_METHODS for m in cfg.methods) or not cfg.methods:
        raise ValueError(f"methods must be a non-empty subset of {ALL_METHODS}, got {cfg.methods!r}")
    if cfg.model not in MODELS:
        raise ValueError(f"model must be one of {tuple(MODELS)}, got {cfg.model!r}")
    flat = [m for m in cfg.methods if m in FLAT_OPTIMIZER]
    if cfg.model == "float8" and flat:
        raise ValueError(f"methods {flat} step with fsdp.FlatAdamW, which does not take the float8 model's "
                         f"tensor-subclass weights; leave them out (--methods {','.join(default_methods('float8'))})")
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


def policy_text(mode: str) -> dict[str, str]:
    if mode == "fp32":
        return {
            "ours": "no policy: main/model/main-grad/reduce all fp32",
            "fsdp2": "no policy: fp32 params, grads, reduce-scatter",
            "floor": "plain fp32 model, fp32 AdamW",
            "flat": "no policy (as ours)",
            "lean": "no policy (as ours; nothing to cast)",
            "flat_bf16_state": "no policy (as ours), FlatAdamW(state_dtype=bfloat16)",
            "row": "no policy (as ours), layout_policy('auto'): flat row-atomic layout",
            "c10d": _REPLAY_TEXT,
        }
    return {
        "ours": "param_dtype=bf16, main_params_dtype=fp32, main_grads_dtype=fp32, reduce_dtype=fp32",
        "fsdp2": "param_dtype=bf16, reduce_dtype=fp32 (sharded params, grads, AdamW fp32)",
        "floor": "bf16 copy of the model (.to(bfloat16)): bf16 weights, grads and AdamW states",
        "flat": "param_dtype=bf16, main_params_dtype=fp32, main_grads_dtype=bf16, reduce_dtype=fp32",
        "lean": "as flat, persistent_param_shard=False (cast the shard before each gather)",
        "flat_bf16_state": "as flat, FlatAdamW(state_dtype=bfloat16): BF16 Adam moments",
        "row": "as ours, layout_policy('auto'): flat row-atomic layout",
        "c10d": _REPLAY_TEXT,
    }


_REPLAY_TEXT = "raw c10d: ours' c10d calls of one step replayed alone (no model, no framework)"


class ReplayMethod:
    """``c10d``: a step is :meth:`comm_replay.Replay.run`; its "loss" is 0 (there is no model)."""

    def __init__(self, trace: list) -> None:
        self.name, self.opt, self.replay = "c10d", None, comm_replay.Replay(trace)
        self.phases: list = []

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        marks = [cpu_mark()]
        self.replay.run()
        marks.append(cpu_mark())
        self.phases.append(phase_costs(marks))  # one phase: the communication
        return torch.zeros(())


class Method:
    """One way of training: a model, its optimizer and ``step(tokens) -> loss``."""

    def __init__(self, name: str, model: torch.nn.Module, cfg: BenchConfig, optimizer=torch.optim.AdamW) -> None:
        from tests.models.llama import loss_fn

        self.name, self.model, self.loss_fn, self.micro = name, model, loss_fn, cfg.micro
        self.opt = optimizer(model.parameters(), lr=cfg.lr, foreach=cfg.foreach)
        # Set ``clock`` (seconds, after waiting for the device) to time each optimizer step alone
        # into ``optimizer_s``; None: not timed (no device synchronisation inside a step).
        self.clock: Optional[Callable[[], float]] = None
        self.optimizer_s: list[float] = []
        # Per step, the CPU cost of forward, backward and optimizer (step + zero_grad): this
        # thread's, the other threads', page faults (tools.kit.timing.phase_costs).
        self.phases: list = []

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """One optimizer step over ``micro`` micro-batches of ``tokens`` (each backward's loss
        divided by ``micro``: the gradients sum to the whole batch's); the phases' costs are the
        micro-batches' forwards, their backwards, then step + zero_grad."""
        fwd, bwd, total = [], [], None
        for part in tokens.chunk(self.micro):
            start = cpu_mark()
            loss = self.loss_fn(self.model(part[:, :-1]), part) / self.micro  # no name keeps the logits
            middle = cpu_mark()
            loss.backward()
            fwd.append(phase_costs([start, middle])[0])
            bwd.append(phase_costs([middle, cpu_mark()])[0])
            total = loss.detach() if total is None else total + loss.detach()
        start, began = cpu_mark(), self.clock() if self.clock is not None else None
        self.opt.step()
        if began is not None:
            self.optimizer_s.append(self.clock() - began)
        self.opt.zero_grad()
        self.phases.append([_summed(fwd), _summed(bwd), phase_costs([start, cpu_mark()])[0]])
        return total


def _summed(costs: list[tuple]) -> tuple:
    return tuple(sum(c[i] for c in costs) for i in range(len(costs[0])))


def optimizer_bytes(method: Method) -> int:
    """The bytes one optimizer step must read and write at least: every stepped weight read and
    written, its gradient read, every state tensor read and written (this rank's pieces). The
    floor of the step's memory traffic: a kernel that moves more (a for-loop optimizer's
    temporaries, an upcast copy) shows as a lower implied bandwidth."""
    from torch.distributed.tensor import DTensor

    import fsdp

    opt = method.opt
    if isinstance(opt, fsdp.FlatOptimizer):
        return opt.bytes_per_step()
    local = [p.to_local() if isinstance(p, DTensor) else p for g in opt.param_groups for p in g["params"]]
    state = [t.to_local() if isinstance(t, DTensor) else t for st in opt.state.values() for t in st.values()
             if torch.is_tensor(t) and t.numel() > 1]
    return sum(3 * t.numel() * t.element_size() for t in local) + sum(2 * t.numel() * t.element_size() for t in state)


def sharded_units(model: torch.nn.Module, which: str) -> list[torch.nn.Module]:
    """The modules of ``model`` that get their own ``fully_shard`` before the root, in order."""
    blocks = list(model.layers)
    return [model.tok_embeddings] + blocks if which == "head_root" else blocks


def _weights(model: torch.nn.Module, name: str, which: str) -> torch.nn.Module:
    """``model`` with the weights of ``which``: float8 all-gather weights for the sharded methods,
    the single-process reference of the same arithmetic (straight-through) for the floor."""
    if which != "float8":
        return copy.deepcopy(model)
    from tests.models.float8_weight import float8_weights, reference_float8_model

    return reference_float8_model(model) if name == "floor" else float8_weights(model)


def build_method(name: str, base: torch.nn.Module, mode: str, cfg: BenchConfig, mesh) -> Method:
    model = _weights(base, name, cfg.model)
    units = sharded_units(model, cfg.model)
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
            for unit in units:
                fsdp.fully_shard(unit, **kw)
            fsdp.fully_shard(model, **kw)
        optimizer = torch.optim.AdamW if name in ("ours", "row") else fsdp.FlatAdamW
        if name == "flat_bf16_state":
            optimizer = functools.partial(fsdp.FlatAdamW, state_dtype=torch.bfloat16)
        return Method(name, model, cfg, optimizer)
    if name == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy()
        if mode == "bf16":
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for unit in units:
            fully_shard(unit, mesh=mesh, mp_policy=policy)
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


def model_config(cfg: BenchConfig):
    from tests.models.llama import LlamaConfig

    return LlamaConfig(vocab_size=cfg.vocab, dim=cfg.dim, n_layers=cfg.layers, n_heads=cfg.heads,
                       hidden_dim=cfg.hidden, max_seq_len=cfg.seq)


def optimizer_impl(method: Method) -> str:
    from torch.optim.optimizer import _default_to_fused_or_foreach

    if method.opt is None:
        return "-"
    foreach = method.opt.defaults.get("foreach")
    if foreach is None:
        params = [p for g in method.opt.param_groups for p in g["params"]]
        _, foreach = _default_to_fused_or_foreach(params, False, False)
    return "foreach" if foreach else "for-loop"
