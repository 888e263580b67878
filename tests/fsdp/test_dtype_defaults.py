"""Dtypes as users expect, with no policy at all: a parameter computes in the dtype it was built in
(as torch FSDP2) and its main weights are FP32 or wider (Megatron's FP32 main weights; a float64
model stays float64). Each test runs torch FSDP2 beside fsdp in the same ranks, and compares
training against one process on the global batch where it can.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import fsdp
from tests.fsdp.models import BATCH, SEQ, VOCAB, make_batches, make_model
from tests.harness import run_ranks
from tests.models.llama import Llama, LlamaConfig


@contextlib.contextmanager
def _gathered_bytes():
    """Bytes that all-gathers wrote in this process inside the block, for fsdp (whose only
    caller of c10d is dbuffer.collectives) and for torch FSDP2 (``dist.all_gather_into_tensor``
    and its 2.13+ name; a call made inside another one is not counted twice)."""
    from dbuffer import collectives

    total = [0]
    depth = [0]
    patched = []

    def counting(owner, name):
        real = getattr(owner, name)

        def wrapper(out, *args, **kwargs):
            if depth[0] == 0:
                total[0] += out.numel() * out.element_size()
            depth[0] += 1
            try:
                return real(out, *args, **kwargs)
            finally:
                depth[0] -= 1

        patched.append((owner, name, real))
        setattr(owner, name, wrapper)

    counting(collectives, "all_gather")
    for name in ("all_gather_into_tensor", "all_gather_single"):
        if hasattr(dist, name):
            counting(dist, name)
    try:
        yield total
    finally:
        for owner, name, real in reversed(patched):
            setattr(owner, name, real)


def _linear_dtypes(model: nn.Module) -> tuple[dict[str, tuple], list]:
    """A forward hook on every nn.Linear recording (input, weight, output) dtypes by name."""
    seen: dict[str, tuple] = {}
    handles = []
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            def hook(mod, args, out, name=name):
                seen[name] = (args[0].dtype, mod.weight.dtype, out.dtype)

            handles.append(m.register_forward_hook(hook))
    return seen, handles


def _bf16_llama_per_block(shard_name: str) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    cfg = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_seq_len=16)
    torch.manual_seed(0)
    model = Llama(cfg).to(torch.bfloat16)  # as from_pretrained(..., dtype=torch.bfloat16) gives it
    shard = {"fsdp": fsdp.fully_shard, "fsdp2": torch_fully_shard}[shard_name]
    for block in model.layers:
        shard(block)
    shard(model)
    seen, handles = _linear_dtypes(model)
    tokens = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(dist.get_rank()))
    with _gathered_bytes() as gathered:
        model(tokens[:, :-1]).float().square().mean().backward()
    for h in handles:
        h.remove()
    out = {"linears": seen, "gathered": gathered[0], "registered": {p.dtype for p in model.parameters()}}
    if shard_name == "fsdp":
        # torch's own policy is accepted by fsdp.fully_shard: an fp32 model computes in bf16 under it
        fp32 = Llama(cfg)
        for block in fp32.layers:
            fsdp.fully_shard(block, mp_policy=TorchPolicy(param_dtype=torch.bfloat16))
        fsdp.fully_shard(fp32, mp_policy=TorchPolicy(param_dtype=torch.bfloat16))
        seen32, _ = _linear_dtypes(fp32)
        fp32(tokens[:, :-1])
        out["torch_policy_linears"] = {d for dtypes in seen32.values() for d in dtypes}
    return out


def test_a_bf16_built_llama_computes_every_linear_in_bf16_and_gathers_no_more_than_fsdp2() -> None:
    ours, theirs = (run_ranks(_bf16_llama_per_block, 2, name, backend="gloo")[0] for name in ("fsdp", "fsdp2"))
    for who, r in (("fsdp", ours), ("fsdp2", theirs)):
        assert r["linears"] and all(d == (torch.bfloat16,) * 3 for d in r["linears"].values()), (who, r["linears"])
    assert ours["linears"].keys() == theirs["linears"].keys()
    assert ours["gathered"] <= theirs["gathered"], (ours["gathered"], theirs["gathered"])
    assert theirs["registered"] == {torch.bfloat16}
    assert ours["registered"] == {torch.float32}  # the FP32 main weights the optimizer steps
    assert ours["torch_policy_linears"] == {torch.bfloat16}


def _float64(model, batches) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    for block in model.blocks:
        fsdp.fully_shard(block)
    fsdp.fully_shard(model)
    losses = _train(model, batches, rank, world)
    dtypes = {p.dtype for p in model.parameters()}
    return {"losses": losses, "dtypes": dtypes, "state": {n: p.detach().full_tensor() for n, p in model.named_parameters()}}


def _train(model, batches, rank: int = 0, world: int = 1, lr: float = 1e-2) -> list[float]:
    """AdamW on this rank's slice; the loss in the logits' own dtype, reduced over ranks."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    losses = []
    for x, y in batches:
        per = x.shape[0] // world
        x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().double()
        if world > 1:
            dist.all_reduce(total)
        losses.append(float(total) / world)
    return losses


def test_a_float64_model_trains_in_float64_equal_to_one_process() -> None:
    model, batches = make_model().double(), make_batches(4)
    ref = copy.deepcopy(model)
    ref_losses = _train(ref, batches)
    r = run_ranks(_float64, 2, model, batches, backend="gloo")[0]
    assert r["dtypes"] == {torch.float64}
    diff = max(float((r["state"][n] - p.detach()).abs().max()) for n, p in ref.named_parameters())
    assert diff < 1e-12, diff  # float32 storage would be ~1e-8 off
    assert max(abs(a - b) for a, b in zip(r["losses"], ref_losses)) < 1e-12


def _bf16_training(model, batches) -> dict:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, shard in (("fsdp", fsdp.fully_shard), ("fsdp2", torch_fully_shard)):
        m = copy.deepcopy(model)
        for block in m.blocks:
            shard(block)
        shard(m)
        out[f"{name}_losses"] = _train(m, batches, rank, world, lr=1e-3)
        out[f"{name}_state"] = {n: p.detach().full_tensor().double() for n, p in m.named_parameters()}
        out[f"{name}_dtypes"] = {p.dtype for p in m.parameters()}
    return out


def test_a_bf16_built_model_trains_near_fsdp2_with_main_weights_closer_to_float64() -> None:
    """Built in bf16, no policy: fsdp keeps FP32 main weights and computes in bf16, FSDP2 keeps and
    steps bf16 weights. Both train the same within bf16 noise, and fsdp's main weights are at least
    as close as FSDP2's to one float64 process trained from the same (bf16-exact) start."""
    model, batches = make_model().to(torch.bfloat16), make_batches(6)
    ref = copy.deepcopy(model).double()
    ref_losses = _train(ref, batches, lr=1e-3)
    r = run_ranks(_bf16_training, 2, model, batches, backend="gloo")[0]
    assert r["fsdp_dtypes"] == {torch.float32} and r["fsdp2_dtypes"] == {torch.bfloat16}
    ours, theirs = r["fsdp_losses"], r["fsdp2_losses"]
    assert max(abs(a - b) for a, b in zip(ours, theirs)) < 2e-2, (ours, theirs)  # bf16 noise at loss ~2.8
    assert max(abs(a - b) for a, b in zip(ours, ref_losses)) < 2e-2, (ours, ref_losses)

    def distance(state):
        return sum(float((state[n] - p.detach()).square().sum()) for n, p in ref.named_parameters()) ** 0.5

    d_ours, d_theirs = distance(r["fsdp_state"]), distance(r["fsdp2_state"])
    print(f"distance to float64: fsdp (FP32 main) {d_ours:.3g}, FSDP2 (bf16) {d_theirs:.3g}")
    assert d_ours <= d_theirs, (d_ours, d_theirs)
