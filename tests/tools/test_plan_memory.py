"""tools/plan_memory.py: measured per-rank bytes against the closed form, the ZeRO ordering of the
categories, independent checks against real training steps (the bytes torch holds after an AdamW
step on a threaded world; the peak working set of forward/backward on a fake world), the
Llama-3-70B preset at world 1024 and the command line; N-D meshes (the Llama TP plan on tp, HSDP):
hand counts with the TP-split weights divided by tp, a real dp 2 x tp 2 AdamW step, the 70B preset
on dp 128 x tp 8 through the command line.

The planner joins (and leaves) a fake process group itself, so these tests need no harness for it;
``test_plan_inside_an_existing_fake_world`` checks that it also works inside ``run_ranks``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from dbuffer import DBuffer
from fsdp import MixedPrecisionPolicy, fully_shard
from fsdp.group.policy import reduces_in_grad_dtype
from tests.harness import run_ranks
from tools.plan_memory import CausalLM, Config, plan
from tools.plan_memory import main as plan_main

ROOT = Path(__file__).resolve().parents[2]
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
POLICIES = {
    "fp32": MixedPrecisionPolicy(),
    "bf16": MixedPrecisionPolicy(param_dtype=torch.bfloat16, main_grads_dtype=torch.bfloat16),
}
VOCAB, DIM, HIDDEN, BLOCKS = 1000, 256, 512, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    """Small shapes that do not divide evenly, a frozen parameter, and a forward for the real run."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.scale = nn.Parameter(torch.ones(DIM), requires_grad=False)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x * self.scale)


def _numel(trainable_only: bool = False) -> int:
    """Parameter elements of the real module (an eager build: independent of the planner)."""
    return sum(p.numel() for p in Net().parameters() if p.requires_grad or not trainable_only)


@pytest.fixture(scope="module")
def plans() -> dict:
    """(world, policy, strategy, rank) -> Plan; the last rank holds most of the padding."""
    return {
        (world, pol, s, rank): plan(Net, world, rank, strategy=s, mp_policy=POLICIES[pol])
        for world in (8, 64)
        for rank in (0, world - 1)
        for pol in POLICIES
        for s in STRATEGIES
    }


def test_every_category_matches_the_closed_form_within_padding(plans) -> None:
    n = _numel()
    for case, p in plans.items():
        assert p.params == n and p.units == BLOCKS + 1 and p.ok, (case, p.format())
        for key, b in p.categories().items():
            assert abs(b.measured - b.closed) <= b.allowance, (case, key, b)
            # The allowance is layout padding, never more (AdamW's two states count it twice).
            assert b.allowance <= 2 * 4 * p.layout_padding, (case, key, b)
        world, s = case[0], case[2]
        # The row-atomic layout identity: the ranks' shards hold the model plus the padding.
        if s != "no_shard":
            assert p.main_weights.measured * world == 4 * (n + p.layout_padding)
            assert p.main_weights.closed == math.ceil(4 * n / world)
        else:
            assert p.main_weights.measured == 4 * (n + p.layout_padding)


@pytest.mark.parametrize("pol", POLICIES)
@pytest.mark.parametrize("world", [8, 64])
def test_zero_stages_shard_what_they_claim(plans, world: int, pol: str) -> None:
    zero = [plans[(world, pol, s, 0)] for s in STRATEGIES]
    n, trained = _numel(), _numel(trainable_only=True)
    model_bytes = 2 if pol == "bf16" else 4

    def near(b, expected: int) -> bool:  # within the padding the layouts add
        return expected <= b.measured <= expected + b.allowance

    # Main weights and optimizer state: whole on ZeRO-0, 1/world from ZeRO-1 on.
    assert near(zero[0].main_weights, 4 * n) and zero[0].optimizer_state.measured == 2 * 4 * trained
    for p in zero[1:]:
        assert p.main_weights.measured == zero[1].main_weights.measured <= 1.25 * 4 * n / world
    # Main grads: whole until ZeRO-2 shards them.
    grad_bytes = 2 if pol == "bf16" else 4
    for p in zero[:2]:
        assert near(p.main_grads, grad_bytes * trained)
    for p in zero[2:]:
        assert p.main_grads.measured <= 1.25 * grad_bytes * trained / world
    # Compute weights: a persistent full copy only for ZeRO-1/2 (ZeRO-0 computes on its model
    # weights); ZeRO-3 gathers them per use and frees them in between.
    assert zero[0].unsharded_weights.measured == zero[3].unsharded_weights.measured == 0
    for p in zero[1:3]:
        assert near(p.unsharded_weights, model_bytes * n)
    assert [p.unsharded_working_set.measured > 0 for p in zero] == [False, False, False, True]
    assert all(p.released_between_uses for p in zero)
    # A separate model copy is kept only by ZeRO-0 with another compute dtype: the sharded stages
    # cast the main shard into each gather's own row. .grad copies only for bf16 grads.
    assert [p.model_weights.measured > 0 for p in zero] == [pol == "bf16", False, False, False]
    assert all((p.grad_copies.measured > 0) == (pol == "bf16") for p in zero)
    # Every stage keeps less than the one before.
    persistent = [p.persistent.measured for p in zero]
    assert persistent == sorted(persistent, reverse=True) and len(set(persistent)) == 4, persistent


def test_no_shard_does_not_scale_with_world_but_shards_do(plans) -> None:
    for pol in POLICIES:
        full = [plans[(w, pol, "no_shard", 0)].main_weights for w in (8, 64)]
        assert abs(full[0].measured - full[1].measured) <= max(b.allowance for b in full)
        for s in STRATEGIES[1:]:
            small, big = plans[(8, pol, s, 0)], plans[(64, pol, s, 0)]
            assert big.main_weights.measured < small.main_weights.measured / 4


def test_meta_and_real_storage_give_the_same_bytes() -> None:
    for s in ("optim", "optim_grads_params"):
        meta = plan(Net, 8, 3, strategy=s, mp_policy=POLICIES["bf16"])
        cpu = plan(Net, 8, 3, strategy=s, mp_policy=POLICIES["bf16"], device="cpu")
        assert meta.categories() == cpu.categories() and cpu.device == "cpu"


# ----------------------------------------------------------------------------- a real step

WORLD = 4


def _real_step(model: nn.Module, strategy: str) -> dict:
    """One AdamW step of ``model`` sharded for real; the bytes torch holds afterwards."""
    torch.manual_seed(0)
    model = copy.deepcopy(model)
    policy = POLICIES["bf16"]
    for block in model.blocks:
        fully_shard(block, mp_policy=policy, sharding_strategy=strategy)
    fully_shard(model, mp_policy=policy, sharding_strategy=strategy)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    tokens = torch.randint(0, VOCAB, (2, 8))
    F.cross_entropy(model(tokens).float().flatten(0, 1), tokens.flatten()).backward()
    opt.step()
    local = lambda t: t._local_tensor if isinstance(t, DTensor) else t  # noqa: E731
    state = [local(t) for s in opt.state.values() for k, t in s.items() if k != "step"]
    grads = [local(p.grad) for p in model.parameters() if p.grad is not None]
    storages = {local(p).untyped_storage().data_ptr(): local(p).untyped_storage().nbytes() for p in model.parameters()}
    return {
        "optimizer_state": sum(t.numel() * t.element_size() for t in state),
        "grad_copies": sum(t.numel() * t.element_size() for t in grads),
        "main_weights": sum(storages.values()),
    }


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_plan_matches_a_real_training_step(strategy: str) -> None:
    torch.manual_seed(0)
    real = run_ranks(_real_step, WORLD, Net(), strategy, backend="threaded")
    # Independent of any layout: the state of every parameter element exists exactly once.
    assert sum(r["optimizer_state"] for r in real) == 2 * 4 * _numel(trainable_only=True)
    for rank, got in enumerate(real):
        p = plan(Net, WORLD, rank, strategy=strategy, mp_policy=POLICIES["bf16"])
        for key, nbytes in got.items():
            assert getattr(p, key).measured == nbytes, (rank, key)


def _working_set_peaks(model: nn.Module, strategy: str) -> dict:
    """Peak bytes held at once by the gather targets and by the ``grad_in`` buffers over three
    training steps (prefetching starts in the second), sampled whenever one gets storage back."""
    policy = POLICIES["bf16"]
    for block in model.blocks:
        fully_shard(block, mp_policy=policy, sharding_strategy=strategy)
    fully_shard(model, mp_policy=policy, sharding_strategy=strategy)
    groups = [g for m in [*model.blocks, model] for g in m._fsdp_state.groups]
    watched = {"unsharded_working_set": [g.weights.unsharded for g in groups] if strategy == "optim_grads_params" else [],
               "reduce_working_set": [g.grads.grad_in for g in groups if g.requires_grad]}
    peaks = dict.fromkeys(watched, 0)
    reallocate = DBuffer.reallocate_storage

    def sampled(buf: DBuffer) -> None:
        reallocate(buf)
        for key, bufs in watched.items():
            peaks[key] = max(peaks[key], sum(b.local_buffer.untyped_storage().nbytes() for b in bufs))

    DBuffer.reallocate_storage = sampled
    try:
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
        for _ in range(3):
            tokens = torch.randint(0, VOCAB, (2, 8))
            F.cross_entropy(model(tokens).float().flatten(0, 1), tokens.flatten()).backward()
            opt.step()
            opt.zero_grad()
    finally:
        DBuffer.reallocate_storage = reallocate
    return peaks


@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
def test_working_set_assumption_matches_a_real_step(strategy: str) -> None:
    """The planner's working sets (fsdp's schedule measured on its own probe model, priced with
    this model's units) are what real forward/backward passes on a fake world of 4 hold at worst."""
    torch.manual_seed(0)
    peaks = run_ranks(_working_set_peaks, WORLD, Net(), strategy, backend="fake")[0]
    p = plan(Net, WORLD, 0, strategy=strategy, mp_policy=POLICIES["bf16"])
    assert peaks["reduce_working_set"] == p.reduce_working_set.measured > 0
    assert peaks["unsharded_working_set"] == p.unsharded_working_set.measured


# ----------------------------------------------------------------------------- presets, CLI


def test_llama3_70b_at_world_1024_is_within_padding_of_the_closed_form() -> None:
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    p = plan("llama3-70b", 1024, strategy="optim_grads_params", mp_policy=bf16)
    print(p.format())
    d, v, f, kv, layers = 8192, 128256, 28672, 1024, 80  # the published config
    block = 2 * d * d + 2 * kv * d + 3 * d * f + 2 * d  # q, o; k, v; gate, up, down; two norms
    n = 2 * v * d + layers * block + d
    assert p.params == n == 70_553_706_496 and p.units == layers + 1
    # FSDP2's torch.chunk pieces (the default) pad only the vocabulary's rows to a multiple of 1024.
    assert p.layouts == {"torch.chunk": layers + 1} and p.layout_policy == "chunk"
    assert p.layout_padding == 2 * (-v % 1024) * d <= 0.001 * (n + p.layout_padding)
    # Megatron's flat layout: row atomicity would pad 2.78% here; every unit is ragged instead and
    # pads <= 0.1% (issue 16), under one element a shard per unit.
    flat = plan("llama3-70b", 1024, strategy="optim_grads_params", mp_policy=bf16, layout="auto")
    assert flat.layouts == {"ragged": layers + 1} and flat.layout_policy == "auto"
    assert flat.layout_padding <= 0.001 * (n + flat.layout_padding)
    assert flat.layout_padding < 1024 * flat.units
    assert flat.ok and abs(flat.total.measured - flat.total.closed) <= flat.total.allowance
    assert p.ok and abs(p.total.measured - p.total.closed) <= p.total.allowance
    assert p.main_weights.closed == math.ceil(4 * n / 1024)
    # ZeRO-3 working set: the root (embedding + lm_head) and k decoder layers gathered in bf16.
    root, k = p.peak_moments["unsharded_working_set"]
    assert root and k >= 1 and p.unsharded_working_set.closed == 2 * ((2 * v * d + d) + k * block)


def test_plan_inside_an_existing_fake_world() -> None:
    p = run_ranks(plan, 16, Net, 16, 5, backend="fake", fake_rank=5)[0]
    assert p.ok and (p.world, p.rank) == (16, 5)
    with pytest.raises(ValueError, match="already exists"):
        run_ranks(plan, 16, Net, 16, 0, backend="fake", fake_rank=5)


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="unknown model preset"):
        plan("gpt-5", 8)
    with pytest.raises(ValueError, match="unknown optimizer"):
        plan(Net, 8, optimizer="lion")
    with pytest.raises(ValueError, match="rank < world"):
        plan(Net, 8, rank=8)


def test_command_line_mixtral_json() -> None:
    out = subprocess.run(
        [sys.executable, "tools/plan_memory.py", "--model", "mixtral-8x7b", "--world", "256", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=True,
    )
    report = json.loads(out.stdout)
    assert report["ok"] and report["params"] == 46_702_792_704 and report["units"] == 33
    reduce = "fp32" if reduces_in_grad_dtype() else "bf16"  # reduce_dtype=None: torch 2.15's gradient dtype
    assert report["dtypes"] == f"main fp32, model bf16, main grads fp32, reduce {reduce}"
    total = report["total"]
    assert abs(total["measured"] - total["closed"]) <= total["allowance"]


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads_params"])
def test_model_shard_and_flat_optimizer_drop_their_categories(strategy: str) -> None:
    """The sharded strategies keep no model shard with either persistent_param_shard setting
    (each gather casts into its own row; no_shard's model weights are its full ones), the flat
    optimizer drops the FP32 grad copies; the measured bytes still match the closed form, and
    the plan names the grad-copy trade-off."""
    bf16 = POLICIES["bf16"]
    lean = dataclasses.replace(bf16, persistent_param_shard=False)
    base = plan(Net, WORLD, 0, strategy=strategy, mp_policy=bf16)
    p = plan(Net, WORLD, 0, strategy=strategy, mp_policy=lean, flat_optimizer=True)
    assert p.ok and base.ok
    assert base.grad_copies.measured > 0 and p.grad_copies.measured == 0
    for q in (base, p):
        assert (q.model_weights.measured > 0) == (strategy == "no_shard"), (strategy, q.model_weights)
    assert "grad copies: none, the flat optimizer" in p.format()
    assert "--flat-optimizer" in base.format()


# ---------------------------------------------------------------- N-D meshes: FSDP x TP, HSDP

# Small Llama shapes; every TP-local dim divides by tp 2 and dp 4, so nothing pads.
TINY = Config("tiny", vocab=1000, dim=64, layers=2, heads=4, kv_heads=2, ffn=128)
TINY_ODD = dataclasses.replace(TINY, vocab=1001)  # the vocabulary splits unevenly on tp and dp


def tiny() -> nn.Module:
    return CausalLM(TINY)


def tiny_odd() -> nn.Module:
    return CausalLM(TINY_ODD)


def _tp_numel(c: Config, tp: int) -> tuple[int, int]:
    """(TP-split, replicated) parameter elements of one TP rank, by hand from the config (the plan:
    q/k/v/o, gate/up/down, embedding and head split; norms replicated); tp must divide evenly."""
    d, kv = c.dim, c.kv_heads * (c.dim // c.heads)
    split = c.layers * (2 * d * d + 2 * kv * d + 3 * d * c.ffn) + 2 * c.vocab * d
    return split // tp, (2 * c.layers + 1) * d


@pytest.mark.parametrize("strategy", ["optim", "optim_grads", "optim_grads_params"])
def test_tp2_dp4_matches_a_hand_count(strategy: str) -> None:
    """world 8 = dp 4 x tp 2: the bytes fsdp holds equal the hand count with the TP-split weights
    divided by tp and the replicated ones not (no padding here, so exactly)."""
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    split, repl = _tp_numel(TINY, 2)
    full_split, _ = _tp_numel(TINY, 1)
    for rank in (0, 5):
        p = plan(tiny, 8, rank, strategy=strategy, mp_policy=bf16, tp=2)
        assert p.ok and p.mesh == {"dp_replicate": 1, "dp_shard": 4, "tp": 2}
        assert p.params == full_split + repl and p.local_params == split + repl
        local = split + repl
        assert p.main_weights.measured == p.main_weights.closed == 4 * local // 4
        assert p.model_weights.measured == 0  # each gather casts the main shard into its own row
        grads_shards = 4 if strategy != "optim" else 1
        assert p.main_grads.measured == 4 * local // grads_shards
        assert p.optimizer_state.measured == 2 * 4 * local // 4
        if strategy == "optim_grads_params":  # ZeRO-3 gathers the TP-local weights over dp only
            assert p.unsharded_weights.measured == 0 and p.unsharded_working_set.measured > 0
        else:
            assert p.unsharded_weights.measured == 2 * local
        assert "dp_shard 4 x tp 2" in p.format()


def test_uneven_tp_and_dp_splits_stay_within_padding() -> None:
    """An odd vocabulary: TP rank 0 holds one more embedding row than TP rank 1, and the dp pieces
    are torch.chunk's (padded); every rank is still within its padding of the closed form."""
    plans = [plan(tiny_odd, 8, rank, tp=2) for rank in range(8)]
    for p in plans:
        assert p.ok, p.format()
    split, repl = _tp_numel(TINY, 2)  # vocab 1000: 500 rows of the embedding and of the head
    for rank, p in enumerate(plans):  # vocab 1001: TP rank 0 holds 501 rows of each, TP rank 1 500
        assert p.local_params == split + repl + (2 * TINY.dim if rank % 2 == 0 else 0)
    assert plans[0].main_weights.measured > plans[1].main_weights.measured


def test_hsdp_with_tp_shards_over_dp_shard_only() -> None:
    """world 16 = replicate 2 x shard 4 x tp 2: the same per-rank bytes as dp 4 x tp 2 (replicas
    hold copies), and plain HSDP (tp 1) divides by dp_shard."""
    plain = plan(tiny, 8, 3, tp=2)
    hsdp = plan(tiny, 16, 11, tp=2, dp_replicate=2)
    assert hsdp.ok and hsdp.mesh == {"dp_replicate": 2, "dp_shard": 4, "tp": 2}
    assert hsdp.main_weights.measured == plain.main_weights.measured
    assert hsdp.optimizer_state.measured == plain.optimizer_state.measured
    split, repl = _tp_numel(TINY, 1)
    only = plan(tiny, 8, 0, dp_replicate=2)
    hand = 4 * (split + repl) // 4  # row-atomic layout here: within its padding of the hand count
    assert only.ok and abs(only.main_weights.measured - hand) <= only.main_weights.allowance < hand // 50


def test_tp_arguments_are_checked_before_sharding() -> None:
    with pytest.raises(ValueError, match="not divisible by tp"):
        plan(tiny, 6, tp=4)
    with pytest.raises(ValueError, match="Llama TP plan"):
        plan(Net, 8, tp=2)
    with pytest.raises(ValueError, match="sharding_strategy"):  # fsdp's own check: TP needs sharded mains
        plan(tiny, 8, tp=2, strategy="no_shard")


def test_command_line_llama3_70b_tp8_dp128(capsys) -> None:
    """The 70B preset on world 1024 = dp 128 x tp 8, through the command line: the JSON says the
    mesh, and the main weights are the hand count of one TP rank's pieces over 128 dp ranks."""
    assert plan_main(["--model", "llama3-70b", "--world", "1024", "--tp", "8", "--rank", "1023", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["mesh"] == {"dp_replicate": 1, "dp_shard": 128, "tp": 8}
    d, v, f, kv, layers = 8192, 128256, 28672, 1024, 80
    local = (2 * v * d + layers * (2 * d * d + 2 * kv * d + 3 * d * f)) // 8 + (2 * layers + 1) * d
    assert report["local_params"] == local
    main_weights = report["main_weights"]
    assert main_weights["closed"] == math.ceil(4 * local / 128)
    assert abs(main_weights["measured"] - main_weights["closed"]) <= main_weights["allowance"]


class BiasedBlock(nn.Module):
    """Llama-named Linears with biases: a column-parallel bias is split, a row-parallel one not."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(32, 64)
        self.o_proj = nn.Linear(64, 32)
        self.norm = nn.Parameter(torch.ones(32))


class BiasedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(BiasedBlock() for _ in range(2))
        self.lm_head = nn.Linear(32, 100, bias=False)


def test_tp_plan_on_a_custom_builder_with_biases() -> None:
    p = plan(BiasedNet, 8, 1, tp=2, strategy="optim_grads")
    assert p.ok, p.format()
    # By hand, per TP rank: q weight + bias halved; o weight halved, its bias and the norm whole.
    block = 64 * 32 // 2 + 64 // 2 + 32 * 64 // 2 + 32 + 32
    assert p.local_params == 2 * block + 100 * 32 // 2


# ---------------------------------------------------------------- TP: a real step on dp 2 x tp 2


class TPBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.Parameter(torch.ones(DIM))
        self.up_proj = nn.Linear(DIM, HIDDEN, bias=False)
        self.down_proj = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down_proj(F.gelu(self.up_proj(x * self.norm)))


class TPNet(nn.Module):
    """Llama-named: the embedding and head split on the (odd) vocabulary, up/down column/row
    parallel, the norm weights replicated."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB + 1, DIM)
        self.layers = nn.ModuleList(TPBlock() for _ in range(2))
        self.lm_head = nn.Linear(DIM, VOCAB + 1, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        for block in self.layers:
            x = block(x)
        return self.lm_head(x)


def _real_tp_step(model: nn.Module) -> dict:
    """One AdamW step of ``model`` under parallelize_module on tp 2 and fully_shard on dp 2 (the
    recipe of fsdp/README.md, "Composing with other features"); the bytes torch holds afterwards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from tools.tp_plan import tp_plan

    torch.manual_seed(0)
    model = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    parallelize_module(model, mesh["tp"], tp_plan(model))
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp_shard"])
    fully_shard(model, mesh=mesh["dp_shard"])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, VOCAB, (2, 8))).float().square().mean().backward()  # local logits
    opt.step()
    local = lambda t: t._local_tensor if isinstance(t, DTensor) else t  # noqa: E731
    state = [local(t) for s in opt.state.values() for k, t in s.items() if k != "step"]
    return {"optimizer_state": sum(t.numel() * t.element_size() for t in state)}


def test_tp_plan_matches_a_real_tp_training_step() -> None:
    """The optimizer state torch allocates on each rank of a real dp 2 x tp 2 step (threaded
    world) is what the planner measures; over all ranks it is two FP32 copies of each TP rank's
    pieces, independent of any layout."""
    torch.manual_seed(0)
    real = run_ranks(_real_tp_step, 4, TPNet(), backend="threaded")
    hidden_split = 2 * (DIM * HIDDEN)  # up + down per layer, split on tp
    per_tp_rank = [2 * hidden_split // 2 + 2 * DIM + (VOCAB + 1 + 1 - 2 * t) // 2 * DIM * 2 for t in (0, 1)]
    assert sum(r["optimizer_state"] for r in real) == 2 * 4 * sum(per_tp_rank)  # vocab 1001: 501 + 500 rows
    for rank, got in enumerate(real):
        p = plan(TPNet, 4, rank, tp=2, mp_policy=MixedPrecisionPolicy())
        assert p.ok and p.optimizer_state.measured == got["optimizer_state"], (rank, got)


def test_tp_meta_and_real_storage_give_the_same_bytes() -> None:
    meta = plan(tiny_odd, 8, 3, tp=2)
    cpu = plan(tiny_odd, 8, 3, tp=2, device="cpu")
    assert meta.categories() == cpu.categories() and cpu.ok and cpu.device == "cpu"


# ----------------------------------------------------------------------------- HFSDP


def _real_hfsdp_step(model: nn.Module) -> dict:
    """_real_step's bytes on a 2 x 2 (replicate, shard) mesh with the optimizer sharded over both."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = copy.deepcopy(model)
    kw = dict(mesh=mesh, mp_policy=POLICIES["bf16"], outer_dp_sharding_strategy="optim")
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    tokens = torch.randint(0, VOCAB, (2, 8))
    F.cross_entropy(model(tokens).float().flatten(0, 1), tokens.flatten()).backward()
    opt.step()
    local = lambda t: t._local_tensor if isinstance(t, DTensor) else t  # noqa: E731
    state = [local(t) for s in opt.state.values() for k, t in s.items() if k != "step"]
    storages = {local(p).untyped_storage().data_ptr(): local(p).untyped_storage().nbytes() for p in model.parameters()}
    return {"optimizer_state": sum(t.numel() * t.element_size() for t in state), "main_weights": sum(storages.values())}


def test_hfsdp_plan_matches_a_real_step_and_divides_the_optimizer_by_the_replicas() -> None:
    """--outer-dp-sharding-strategy optim: the planner's main weights and optimizer state are a
    real HFSDP step's on every rank of 2 x 2, and R = 2 times less than HSDP's within padding."""
    torch.manual_seed(0)
    real = run_ranks(_real_hfsdp_step, WORLD, Net(), backend="threaded")
    assert sum(r["optimizer_state"] for r in real) == 2 * 4 * _numel(trainable_only=True)  # each element once
    for rank, got in enumerate(real):
        p = plan(Net, WORLD, rank, mp_policy=POLICIES["bf16"], dp_replicate=2, outer_dp_sharding_strategy="optim")
        assert p.ok, p.format()
        for key, nbytes in got.items():
            assert getattr(p, key).measured == nbytes, (rank, key)
        hsdp = plan(Net, WORLD, rank, mp_policy=POLICIES["bf16"], dp_replicate=2)
        state = p.optimizer_state
        assert abs(2 * state.measured - hsdp.optimizer_state.measured) <= 2 * (state.allowance + hsdp.optimizer_state.allowance)
    with pytest.raises(ValueError, match="dp_replicate > 1"):
        plan(Net, WORLD, 0, outer_dp_sharding_strategy="optim")
