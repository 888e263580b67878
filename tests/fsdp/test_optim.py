"""fsdp.optim: flat optimizer steps over the DBuffer shards.

* fp32: equal to torch.optim on the same fsdp model (bit for bit) and to single-process training
  on the global batch, for every strategy, AdamW / Adam / SGD, micro-batches, unused parameters;
* BF16 main grads: as close to the fp32 reference as torch.optim on the same fsdp model with the
  same policy (which upcasts whole gradients), and no FP32 tensor the size of a gradient shard is
  made during backward or the step (every op's outputs are tracked);
* state_dict round trip, LR schedulers, errors.
"""

from __future__ import annotations

import contextlib
import copy
import weakref

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

import fsdp
from dbuffer import collectives
from tests.fsdp.models import TinyLM, full_state, loss_fn, make_batches, make_model, max_diff, reference, train
from tests.harness import run_ranks

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
STEPS = 4
LR = 1e-2


def shard(model, **kw):
    for block in model.blocks:
        fsdp.fully_shard(block, **kw)
    return fsdp.fully_shard(model, **kw)


OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, dict(lr=LR, weight_decay=0.1)),
    "adam": (torch.optim.Adam, dict(lr=LR, weight_decay=0.1, amsgrad=True)),
    "sgd": (torch.optim.SGD, dict(lr=LR, momentum=0.9, weight_decay=0.1, nesterov=True)),
}


def _fp32_parity(model, batches, ref_by_opt, chunk_numel, combos) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for strategy, name, micro in combos:
        cls, kw = OPTIMIZERS[name]
        flat_model = shard(copy.deepcopy(model), sharding_strategy=strategy)
        torch_model = shard(copy.deepcopy(model), sharding_strategy=strategy)
        train(
            flat_model, batches, rank=rank, world=world, micro=micro,
            make_opt=lambda params: fsdp.FlatOptimizer(params, cls, chunk_numel=chunk_numel, **kw),
        )
        train(torch_model, batches, rank=rank, world=world, micro=micro, make_opt=lambda params: cls(params, **kw))
        flat, ref_torch = full_state(flat_model), full_state(torch_model)
        out[(strategy, name, micro)] = (max_diff(flat, ref_torch), max_diff(flat, ref_by_opt[name]))
    return out


# every strategy with AdamW (micro-batches too); every optimizer on ZeRO-3 and ZeRO-1
GLOO_COMBOS = [(s, "adamw", 2) for s in STRATEGIES] + [
    ("optim_grads_params", "adam", 2), ("optim_grads_params", "sgd", 2),
]
THREADED_COMBOS = [(s, n, 1) for s in ("optim", "optim_grads_params") for n in OPTIMIZERS]


@pytest.mark.parametrize(
    "backend,world,chunk_numel,combos", [("gloo", 2, 1 << 20, GLOO_COMBOS), ("threaded", 4, 7, THREADED_COMBOS)]
)
def test_fp32_equals_torch_optim_and_single_process(backend, world, chunk_numel, combos) -> None:
    """Bit for bit torch.optim's weights (same kernels, same per-element ops, chunks of 7
    elements included), and single-process training's to float rounding."""
    model, batches = make_model(), make_batches(STEPS)
    refs = {
        name: reference(model, batches, make_opt=lambda params, cls=cls, kw=kw: cls(params, **kw))
        for name, (cls, kw) in OPTIMIZERS.items()
    }
    table = run_ranks(_fp32_parity, world, model, batches, refs, chunk_numel, combos, backend=backend)[0]
    for key, (vs_torch, vs_single) in table.items():
        print(f"{backend} world={world} chunk={chunk_numel} {key}: vs torch.optim {vs_torch:.3g}, vs 1 process {vs_single:.3g}")
    assert all(vs_torch == 0.0 for vs_torch, _ in table.values()), table
    assert all(vs_single <= 1e-5 for _, vs_single in table.values()), table


# ----------------------------------------------------------------------------- BF16 main grads


BF16_GRADS = fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, main_grads_dtype=torch.bfloat16)


class _FP32Allocations(TorchDispatchMode):
    """FP32 tensors made while active (DTensors count their local tensors); ``peak``: the most
    bytes of them alive at once after any op run while ``measuring``.

    gloo's reduce-scatter scratch (dbuffer's workspace pool) is not counted: it is backend memory
    (NCCL's is not even visible here), not a gradient copy, and gloo's worker thread may drop its
    reference to a finished collective's buffers a moment after ``wait()`` returns, so whether it
    is still alive at the step is a matter of thread timing."""

    def __init__(self) -> None:
        super().__init__()
        self.alive: list = []
        self.peak = 0
        self.measuring = False
        self.scratch: list = []  # weak references to the workspaces taken while active
        self._take = collectives._WORKSPACES.take

    def __enter__(self):
        collectives._WORKSPACES.take = self._recording_take
        return super().__enter__()

    def __exit__(self, *exc):
        collectives._WORKSPACES.take = self._take
        return super().__exit__(*exc)

    def _recording_take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        workspace = self._take(numel, dtype)  # the pool's buffer, or a leading view of it
        self.scratch.append(weakref.ref(workspace if workspace._base is None else workspace._base))
        return workspace

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in _locals((args, kwargs))}
        for t in _locals(out):
            storage = t.untyped_storage()
            if t.dtype == torch.float32 and storage.nbytes() and storage.data_ptr() not in inputs:
                self.alive.append(weakref.ref(t))
        if self.measuring:
            self.alive = [r for r in self.alive if r() is not None]
            scratch = {r().untyped_storage().data_ptr() for r in self.scratch if r() is not None}
            live = {r().untyped_storage().data_ptr(): r().untyped_storage().nbytes() for r in self.alive}
            live = {ptr: nbytes for ptr, nbytes in live.items() if ptr not in scratch}
            self.peak = max(self.peak, sum(live.values()))
        return out


def _locals(tree) -> list[torch.Tensor]:
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import tree_leaves

    out = []
    for t in tree_leaves(tree):
        if isinstance(t, DTensor):
            t = t._local_tensor
        if isinstance(t, torch.Tensor) and not t.is_meta:
            out.append(t)
    return out


def _bf16_step_memory(model, batches, chunk_numel) -> dict:
    from tests.fsdp.models import loss_fn

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for kind in ("torch", "flat"):
        m = shard(copy.deepcopy(model), mp_policy=BF16_GRADS)
        params = list(m.parameters())
        if kind == "flat":
            opt = fsdp.FlatAdamW(params, lr=LR, weight_decay=0.1, chunk_numel=chunk_numel)
        else:
            opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.1)
        peaks = []
        for step, (x, y) in enumerate(batches):
            per = x.shape[0] // world
            loss = loss_fn(m, x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per])
            tracker = _FP32Allocations()
            with tracker if step > 0 else contextlib.nullcontext():  # step 0 makes the optimizer state
                loss.backward()
                if kind == "flat":
                    assert all(p.grad is None and p.main_grad.dtype == torch.bfloat16 for p in params)
                tracker.measuring = True
                opt.step()
            opt.zero_grad()
            peaks.append(tracker.peak)
        shard_bytes = sum(p.to_local().numel() for p in params) * 4
        out[kind] = (max(peaks), shard_bytes, full_state(m))
    return out


def test_bf16_main_grads_make_no_fp32_gradient_copy() -> None:
    """torch.optim needs FP32 ``.grad``: a cast copy of every gradient shard, made at the end of
    backward and alive through the step (the tracker sees all of it, which shows it can). The flat step upcasts ``chunk_numel`` elements at a time:
    its FP32 temporaries stay a few chunks, far below one gradient shard. Both give the same
    weights bit for bit (same per-element math)."""
    chunk = 16
    out = run_ranks(_bf16_step_memory, 2, make_model(), make_batches(2), chunk, backend="gloo")
    for rank_out in out:
        torch_peak, shard_bytes, torch_state = rank_out["torch"]
        flat_peak, _, flat_state = rank_out["flat"]
        print(f"shard {shard_bytes} B; fp32 made during backward+step: torch.optim {torch_peak} B, flat {flat_peak} B")
        assert torch_peak >= shard_bytes
        assert flat_peak <= 8 * chunk * 4 < shard_bytes
        assert max_diff(flat_state, torch_state) == 0.0


def _bf16_parity(model, batches, micro) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for strategy in STRATEGIES:
        flat_model = shard(copy.deepcopy(model), sharding_strategy=strategy, mp_policy=BF16_GRADS)
        torch_model = shard(copy.deepcopy(model), sharding_strategy=strategy, mp_policy=BF16_GRADS)
        train(flat_model, batches, rank=rank, world=world, micro=micro,
              make_opt=lambda params: fsdp.FlatAdamW(params, lr=LR, weight_decay=0.1, chunk_numel=5))
        train(torch_model, batches, rank=rank, world=world, micro=micro)
        out[strategy] = max_diff(full_state(flat_model), full_state(torch_model))
    return out


def test_bf16_main_grads_equal_torch_optim_every_strategy() -> None:
    """Same policy, same per-element math: the flat step (which writes the BF16 model shard in
    its pass) equals torch.optim (whose model shard is cast before the next forward) exactly."""
    table = run_ranks(_bf16_parity, 2, make_model(), make_batches(STEPS), 2, backend="gloo")[0]
    print(table)
    assert all(v == 0.0 for v in table.values()), table


# ----------------------------------------------------------------------------- step counts, state, errors


class SkipLM(TinyLM):
    """Block 1 runs only on even steps: its parameters get no gradient on odd ones, so their
    step counts fall behind the others' (torch.optim skips them; so must the flat step)."""

    step = 0

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for i, block in enumerate(self.blocks):
            if i != 1 or self.step % 2 == 0:
                x = block(x)
        self.step += 1
        return self.head(self.norm(x))


def _skipped_params(model, batches) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for per_block in (False, True):
        ms = []
        for kind in ("flat", "torch"):
            m = copy.deepcopy(model)
            if per_block:
                for block in m.blocks:
                    fsdp.fully_shard(block)
            fsdp.fully_shard(m)
            make = (lambda ps: fsdp.FlatAdamW(ps, lr=LR, weight_decay=0.1)) if kind == "flat" else None
            train(m, batches, rank=rank, world=world, make_opt=make)
            ms.append(full_state(m))
        out[per_block] = (max_diff(*ms), ms[0])
    return out


def test_parameters_without_gradients_are_skipped_like_torch() -> None:
    torch.manual_seed(0)
    model = SkipLM()
    table = run_ranks(_skipped_params, 2, model, make_batches(STEPS), backend="gloo")[0]
    ref = reference(model, make_batches(STEPS))
    for per_block, (vs_torch, flat) in table.items():
        assert vs_torch == 0.0, (per_block, vs_torch)
        assert max_diff(flat, ref) <= 1e-5, per_block


def _resume(model, batches) -> float:
    """Train 2 steps, save the optimizer (and scheduler) state, go on 2 steps; a second model
    loads the weights and the state and does the same 2 steps: the results must be equal."""
    from tests.fsdp.models import loss_fn

    rank, world = dist.get_rank(), dist.get_world_size()

    def steps(m, opt, sched, part):
        for x, y in part:
            per = x.shape[0] // world
            loss_fn(m, x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]).backward()
            opt.step()
            sched.step()
            opt.zero_grad()

    def build(m):
        opt = fsdp.FlatAdamW(m, lr=LR, weight_decay=0.1)
        return opt, torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)

    a = shard(copy.deepcopy(model), mp_policy=BF16_GRADS)
    opt_a, sched_a = build(a)
    steps(a, opt_a, sched_a, batches[:2])
    saved = tree_map(
        lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v),
        {"model": a.state_dict(), "opt": opt_a.state_dict(), "sched": sched_a.state_dict()},
    )
    steps(a, opt_a, sched_a, batches[2:])
    b = shard(copy.deepcopy(model), mp_policy=BF16_GRADS)
    opt_b, sched_b = build(b)
    b.load_state_dict(saved["model"])
    opt_b.load_state_dict(saved["opt"])
    sched_b.load_state_dict(saved["sched"])
    assert opt_b.param_groups[0]["lr"] == LR * 0.25
    steps(b, opt_b, sched_b, batches[2:])
    return max_diff(full_state(a), full_state(b))


def test_state_dict_round_trip_with_lr_scheduler() -> None:
    assert run_ranks(_resume, 2, make_model(), make_batches(STEPS), backend="gloo") == [0.0, 0.0]


def _errors(model) -> list[str]:
    m = shard(copy.deepcopy(model))
    params = list(m.parameters())
    caught = []
    for call in (
        lambda: fsdp.FlatAdamW([torch.nn.Parameter(torch.zeros(3))]),
        lambda: fsdp.FlatAdamW(params[:1]),
        lambda: fsdp.FlatOptimizer(params, torch.optim.RMSprop),
        lambda: fsdp.FlatAdamW(params, lr=-1.0),
        lambda: fsdp.FlatAdamW(params, chunk_numel=0),
        lambda: fsdp.FlatAdamW([{"params": params[:1]}, {"params": params[1:]}]),
    ):
        try:
            call()
        except (TypeError, ValueError) as e:
            caught.append(f"{type(e).__name__}: {e}")
        else:
            caught.append("no error")
    opt = fsdp.FlatAdamW(m)
    m.to(torch.float64)
    try:
        opt.step()
    except RuntimeError as e:
        caught.append(f"RuntimeError: {e}")
    return caught


def test_bad_arguments_raise_naming_the_fix() -> None:
    caught = run_ranks(_errors, 2, make_model(), backend="threaded")[0]
    print("\n".join(caught))
    expected = [
        "TypeError: FlatOptimizer: a parameter of shape (3,) was not sharded",
        "ValueError: FlatOptimizer: param group 0 holds part of an fsdp group",
        "TypeError: FlatOptimizer: optimizer_class must be one of AdamW, Adam, SGD",
        "ValueError: Invalid learning rate",
        "ValueError: FlatOptimizer: chunk_numel must be a positive int",
        "ValueError: FlatOptimizer: parameters",
        "RuntimeError: FlatOptimizer: the buffers of parameters",
    ]
    assert len(caught) == len(expected)
    for got, want in zip(caught, expected):
        assert got.startswith(want), (got, want)


def _clipped(model, batches, policy) -> dict:
    """FlatAdamW + its clip_grad_norm_ against torch.optim.AdamW + torch's clip_grad_norm_ on
    the same fsdp model (whose .grad are FP32: views, or cast copies of BF16 main grads)."""
    from tests.fsdp.models import loss_fn

    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for kind in ("flat", "torch"):
        m = shard(copy.deepcopy(model), mp_policy=policy)
        params = list(m.parameters())
        opt = fsdp.FlatAdamW(params, lr=LR) if kind == "flat" else torch.optim.AdamW(params, lr=LR)
        norms = []
        for x, y in batches:
            per = x.shape[0] // world
            loss_fn(m, x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]).backward()
            if kind == "flat":
                norm = opt.clip_grad_norm_(0.05)
            else:
                norm = torch.nn.utils.clip_grad_norm_(params, 0.05).full_tensor()
            norms.append(float(norm))
            opt.step()
            opt.zero_grad()
        results[kind] = (norms, full_state(m))
    (flat_norms, flat), (torch_norms, ref) = results["flat"], results["torch"]
    return {"norms": max(abs(a - b) / b for a, b in zip(flat_norms, torch_norms)), "weights": max_diff(flat, ref),
            "clipped": min(torch_norms) > 0.05}


@pytest.mark.parametrize("policy", [fsdp.MixedPrecisionPolicy(), BF16_GRADS], ids=["fp32", "bf16-main-grads"])
def test_clip_grad_norm_matches_torch(policy) -> None:
    out = run_ranks(_clipped, 2, make_model(), make_batches(3), policy, backend="gloo")[0]
    print(out)
    assert out["clipped"]  # every step was clipped: the scaling is exercised
    assert out["norms"] <= 1e-5
    assert out["weights"] <= (1e-6 if policy == fsdp.MixedPrecisionPolicy() else 1e-3)  # bf16: the scale rounds in bf16


def _flat_main_grad_lifetime(model, batches) -> dict:
    """FlatAdamW with BF16 main grads: ``zero_grad()`` frees every group's main-grad storage at
    once (nothing waits for the next forward); ``zero_grad(set_to_none=False)`` keeps it, zeroed,
    and the next backward accumulates into it. Both train the same weights bit for bit."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for set_to_none in (True, False):
        m = shard(copy.deepcopy(model), mp_policy=BF16_GRADS)
        groups = [g for mod in m.modules() if isinstance(mod, fsdp.FSDPModule)
                  for g in mod._fsdp_state.groups if g.requires_grad]
        opt = fsdp.FlatAdamW(m, lr=LR, weight_decay=0.1)
        after_zero: list[list[bool]] = []
        zeros: list[bool] = []
        for x, y in batches:
            per = x.shape[0] // world
            loss_fn(m, x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]).backward()
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
            after_zero.append([g.grads.main_grad.is_storage_released() for g in groups])
            if not set_to_none:
                zeros.append(all(float(g.grads.main_grad.local_buffer.abs().max()) == 0 for g in groups))
        out[set_to_none] = (after_zero, zeros, full_state(m))
    return out


def test_flat_optimizer_frees_bf16_main_grads_at_zero_grad() -> None:
    model, batches = make_model(), make_batches(3)
    for out in run_ranks(_flat_main_grad_lifetime, 2, model, batches, backend="threaded"):
        (freed, _, state_none), (kept, zeros, state_zero) = out[True], out[False]
        assert all(all(row) for row in freed) and len(freed) == 3
        assert not any(any(row) for row in kept) and all(zeros)
        assert max_diff(state_none, state_zero) == 0.0


def _bytes_per_step(model) -> dict:
    out = {}
    for name, policy, amsgrad in (("fp32", fsdp.MixedPrecisionPolicy(), False), ("bf16", BF16_GRADS, False),
                                  ("bf16 amsgrad", BF16_GRADS, True)):
        m = shard(copy.deepcopy(model), mp_policy=policy)
        opt = fsdp.FlatAdamW(m, lr=LR, amsgrad=amsgrad)
        out[name] = (opt.bytes_per_step(), sum(p.to_local().numel() for p in m.parameters()))
    return out


def test_bytes_per_step_counts_weights_grads_and_state_of_this_rank() -> None:
    """Per element of this rank's pieces: FP32 main weights read and written (8 B), the gradient
    read in its dtype (4 B, or 2 B as BF16 main grads), each FP32 state tensor read and written
    (8 B each: 2 for AdamW, 3 with amsgrad)."""
    for out in run_ranks(_bytes_per_step, 2, make_model(), backend="threaded"):
        assert out["fp32"][0] == out["fp32"][1] * (8 + 4 + 2 * 8)
        assert out["bf16"][0] == out["bf16"][1] * (8 + 2 + 2 * 8)
        assert out["bf16 amsgrad"][0] == out["bf16 amsgrad"][1] * (8 + 2 + 3 * 8)


# ----------------------------------------------------------------------------- BF16 optimizer state


class _BF16StateAdamW(torch.optim.Optimizer):
    """The reference, written out: AdamW in FP32 arithmetic whose two moments are stored in BF16
    (read upcast, written back rounded to nearest), one plain tensor at a time."""

    def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            (b1, b2), lr = group["betas"], group["lr"]
            for p in group["params"]:
                st = self.state[p]
                if not st:
                    st["t"], st["m"], st["v"] = 0, torch.zeros_like(p, dtype=torch.bfloat16), torch.zeros_like(p, dtype=torch.bfloat16)
                st["t"] += 1
                m, v = st["m"].float(), st["v"].float()
                p.mul_(1 - lr * group["weight_decay"])
                m.lerp_(p.grad, 1 - b1)
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                denom = (v.sqrt() / (1 - b2 ** st["t"]) ** 0.5).add_(group["eps"])
                p.addcdiv_(m, denom, value=-lr / (1 - b1 ** st["t"]))
                st["m"].copy_(m)
                st["v"].copy_(v)


def _bf16_state(model, batches, chunk_numel) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    m = shard(copy.deepcopy(model))
    opt = fsdp.FlatAdamW(m, lr=LR, weight_decay=0.1, state_dtype=torch.bfloat16, chunk_numel=chunk_numel)
    train(m, batches[:2], rank=rank, world=world, micro=2, make_opt=lambda params: opt)
    saved = copy.deepcopy(opt.state_dict())
    resumed = fsdp.FlatAdamW(m, lr=LR, weight_decay=0.1, state_dtype=torch.bfloat16, chunk_numel=chunk_numel)
    resumed.load_state_dict(saved)
    train(m, batches[2:], rank=rank, world=world, micro=2, make_opt=lambda params: resumed)
    states = [t for st in resumed.state.values() for t in st.values() if torch.is_tensor(t)]
    return {"state": full_state(m), "dtypes": {t.dtype for t in states},
            "state_bytes": sum(t.nbytes for t in states), "main_bytes": sum(p.to_local().nbytes for p in m.parameters())}


def test_bf16_state_equals_written_out_reference_and_halves_the_state() -> None:
    """``state_dtype=torch.bfloat16``: the moments live in BF16 (2 B each per element, against
    the FP32 main weights' 4 B), a state_dict round trip keeps them there, and the weights are the
    written-out reference's (one process, global batch): bit for bit at world 1 (chunks of 7
    elements), and at world 2 to where the reduced gradients' rounding flips a BF16 rounding of
    the state, below FP32-state AdamW's distance from the reference."""
    model, batches = make_model(), make_batches(STEPS)
    ref_bf16 = reference(model, batches, micro=2, make_opt=lambda params: _BF16StateAdamW(params, lr=LR, weight_decay=0.1))
    ref_fp32 = reference(model, batches, micro=2, make_opt=lambda params: torch.optim.AdamW(params, lr=LR, weight_decay=0.1))
    apart = max_diff(ref_fp32, ref_bf16)
    for world in (1, 2):
        for out in run_ranks(_bf16_state, world, model, batches, 7, backend="threaded"):
            assert out["dtypes"] == {torch.bfloat16}
            assert out["state_bytes"] == out["main_bytes"]  # two BF16 moments = one FP32 weight
            vs_ref = max_diff(out["state"], ref_bf16)
            print(f"world {world}: bf16 state vs written-out reference {vs_ref:.3g}; fp32-state AdamW {apart:.3g}")
            assert vs_ref == 0.0 if world == 1 else vs_ref < apart


def test_state_dtype_refuses_what_it_cannot_keep() -> None:
    def errors(model) -> list[str]:
        sharded = shard(copy.deepcopy(model))
        out = []
        for bad in (torch.float16, "bf16"):
            with pytest.raises(ValueError, match="state_dtype must be None") as e:
                fsdp.FlatAdamW(sharded, lr=LR, state_dtype=bad)
            out.append(str(e.value))
        offloaded = shard(copy.deepcopy(model), offload_policy=fsdp.OptimizerStateOffloadPolicy())
        with pytest.raises(ValueError, match="state_dtype with fsdp.OptimizerStateOffloadPolicy"):
            fsdp.FlatAdamW(offloaded, lr=LR, state_dtype=torch.bfloat16)
        return out

    for out in run_ranks(errors, 2, make_model(), backend="threaded"):
        assert len(out) == 2


# ----------------------------------------------------------------------------- the fused kernel


_ADAM_CALLS: dict[int, list] = {}  # thread (a threaded rank) -> (fused, foreach, numel) per kernel call


def _fused_choice(model, batches) -> dict:
    import threading

    rank, world = dist.get_rank(), dist.get_world_size()
    calls = _ADAM_CALLS.setdefault(threading.get_ident(), [])
    out = {}
    for name, make in (("flat", lambda m: fsdp.FlatAdamW(m, lr=LR, weight_decay=0.1)),
                       ("flat, foreach asked", lambda m: fsdp.FlatAdamW(m, lr=LR, weight_decay=0.1, foreach=True)),
                       ("flat, bf16 grads", lambda m: fsdp.FlatAdamW(m, lr=LR, weight_decay=0.1))):
        m = shard(copy.deepcopy(model), mp_policy=BF16_GRADS if "bf16" in name else fsdp.MixedPrecisionPolicy())
        calls.clear()
        train(m, batches, rank=rank, world=world, make_opt=lambda params: make(m))
        groups = sum(1 for mod in m.modules() if isinstance(mod, fsdp.FSDPModule))
        out[name] = (full_state(m), list(calls), groups)
    m = shard(copy.deepcopy(model))
    train(m, batches, rank=rank, world=world,
          make_opt=lambda params: torch.optim.AdamW(params, lr=LR, weight_decay=0.1, fused=True))
    out["torch fused"] = full_state(m)
    return out


def test_fused_by_default_steps_each_group_in_one_fused_call(monkeypatch) -> None:
    """Where :func:`fused_by_default` says so (CUDA; here driven on CPU), a FlatAdamW left to
    choose runs torch's fused kernel once per group per step (FP32 grads: nothing to upcast, so
    no chunks) and follows ``torch.optim.AdamW(fused=True)`` to rounding (its vectorised loop
    splits at other places); asked for foreach, it keeps foreach; BF16 main grads are still
    upcast chunk by chunk."""
    import threading

    import fsdp.optim.flat as flat
    import fsdp.optim.flat_kernels as kernels

    real = kernels._adam

    def counting(*args, **kw):
        _ADAM_CALLS.setdefault(threading.get_ident(), []).append((kw["fused"], kw["foreach"], args[0][0].numel()))
        return real(*args, **kw)

    monkeypatch.setattr(kernels, "_adam", counting)
    monkeypatch.setattr(flat, "fused_by_default", lambda device: True)
    model, batches = make_model(), make_batches(3)
    for out in run_ranks(_fused_choice, 2, model, batches, backend="threaded"):
        state, calls, groups = out["flat"]
        assert {c[:2] for c in calls} == {(True, None)} and len(calls) == 3 * groups, calls
        assert max_diff(state, out["torch fused"]) <= 1e-6
        assert {c[:2] for c in out["flat, foreach asked"][1]} == {(None, True)}
        bf16_calls, bf16_groups = out["flat, bf16 grads"][1], out["flat, bf16 grads"][2]
        assert {c[:2] for c in bf16_calls} == {(True, None)} and len(bf16_calls) > 3 * bf16_groups
    monkeypatch.undo()
    assert not flat.fused_by_default(torch.device("cpu")) and flat.fused_by_default(torch.device("cuda", 0))
