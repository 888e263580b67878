"""Activation checkpointing composes with fully_shard, in every way users apply it.

HF transformers 4's ``gradient_checkpointing_enable()`` makes each decoder layer run as
``torch.utils.checkpoint.checkpoint(layer.__call__, ...)``: the unit's forward hooks run inside the
checkpointed region, and again when backward recomputes it. transformers 5 checkpoints the
layer's ``forward`` instead, and torch's ``checkpoint_wrapper`` / ``apply_activation_checkpointing``
applied *before* ``fully_shard`` wraps the module the hooks are on: the hooks stay outside, and
the recomputation reads whatever parameters the module has registered at that moment (they must
be the unsharded ones the unit's backward differentiates). Both must train
exactly like single-process training of the global batch without checkpointing, and like torch
FSDP2 with the same checkpointing (fp32, 1e-6), whether the units reshard after forward (the
recomputation must gather again) or not.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import checkpoint

import fsdp
from tests.harness import run_ranks
from tests.models.llama import Block, Llama, LlamaConfig, loss_fn

CONFIG = LlamaConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, hidden_dim=24, max_seq_len=8)
STEPS, BATCH, SEQ = 3, 4, 8
TOLERANCE = 1e-6


class HFBlock(Block):
    """A decoder layer as transformers >= 5 checkpoints it: its ``forward`` (not ``__call__``)
    runs under ``checkpoint``, so the unit's hooks stay outside the checkpointed region."""

    gradient_checkpointing = False
    use_reentrant = False

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.gradient_checkpointing and self.training:
            return checkpoint(super().forward, x, cos, sin, use_reentrant=self.use_reentrant)
        return super().forward(x, cos, sin)


class HFStyleLlama(Llama):
    """The Llama with HF's ``gradient_checkpointing_enable``: ``style="call"`` as transformers 4
    does it, each layer called as ``checkpoint(layer.__call__, ...)`` (the unit's forward hooks
    run inside the checkpointed region, and again in the recomputation); ``style="forward"`` as
    transformers 5 does it (:class:`HFBlock`)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__(cfg)
        self.layers = nn.ModuleList(HFBlock(cfg) for _ in range(cfg.n_layers))
        self.checkpoint_calls = False
        self.use_reentrant = False

    def gradient_checkpointing_enable(self, use_reentrant: bool, style: str) -> None:
        self.use_reentrant = use_reentrant
        if style == "call":
            self.checkpoint_calls = True
        for layer in self.layers:
            if style == "forward":
                layer.gradient_checkpointing, layer.use_reentrant = True, use_reentrant

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rope(tokens.shape[1])
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            if self.checkpoint_calls and self.training:
                h = checkpoint(layer.__call__, h, cos, sin, use_reentrant=self.use_reentrant)
            else:
                h = layer(h, cos, sin)
        return self.lm_head(self.norm(h))


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ + 1), generator=g) for _ in range(STEPS)]


def _train(model: nn.Module, batches, rank: int = 0, world: int = 1) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    per = BATCH // world
    for tokens in batches:
        tokens = tokens[rank * per : (rank + 1) * per]
        loss_fn(model(tokens[:, :-1]), tokens).backward()
        opt.step()
        opt.zero_grad()


def _full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full fp32 parameters by name, without the names checkpoint_wrapper adds."""
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name.replace("_checkpoint_wrapped_module.", "")] = t.detach().float().clone()
    return out


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@functools.lru_cache(maxsize=1)
def _model_and_reference() -> tuple[HFStyleLlama, list, dict]:
    torch.manual_seed(0)
    model = HFStyleLlama(CONFIG)
    batches = _batches()
    ref = copy.deepcopy(model)
    _train(ref, batches)  # one process, the global batch, no checkpointing
    return model, batches, _full_state(ref)


def _checkpointed(model: HFStyleLlama, how: str, reentrant: bool, shard, reshard_after_forward: bool) -> nn.Module:
    """Apply checkpointing ``how`` ("hf{4,5}_{before,after}": HF's switch, transformers 4 or 5
    style, before or after sharding; "wrapper_before"/"wrapper_after": torch's
    apply_activation_checkpointing before sharding, or checkpoint_wrapper around the already
    sharded layers) and shard with ``shard`` (ours or torch's fully_shard): one unit per layer
    and the root."""
    impl = CheckpointImpl.REENTRANT if reentrant else CheckpointImpl.NO_REENTRANT
    hf_style = {"hf4": "call", "hf5": "forward"}.get(how.split("_")[0])
    if hf_style and how.endswith("_before"):
        model.gradient_checkpointing_enable(reentrant, hf_style)
    if how == "wrapper_before":
        apply_activation_checkpointing(
            model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=impl),
            check_fn=lambda m: isinstance(m, Block),
        )
    for layer in model.layers:
        shard(layer, reshard_after_forward=reshard_after_forward)
    if how == "wrapper_after":
        for k, layer in enumerate(model.layers):
            model.layers[k] = checkpoint_wrapper(layer, checkpoint_impl=impl)
    shard(model, reshard_after_forward=reshard_after_forward)
    if hf_style and how.endswith("_after"):
        model.gradient_checkpointing_enable(reentrant, hf_style)
    return model


def _layer_units(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.layers.modules() if isinstance(m, fsdp.FSDPModule)]


def _train_setups(model, batches, ref, how: str, reentrant: bool) -> dict:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for reshard_after_forward in (True, False):
        theirs = _checkpointed(copy.deepcopy(model), how, reentrant, torch_fully_shard, reshard_after_forward)
        _train(theirs, batches, rank, world)
        ours = _checkpointed(copy.deepcopy(model), how, reentrant, fsdp.fully_shard, reshard_after_forward)
        _train(ours, batches, rank, world)
        # after a forward, resharding layers hold no gathered weights: the recomputation in
        # backward had to gather them again
        tokens = batches[0][rank * (BATCH // world) : (rank + 1) * (BATCH // world)]
        loss = loss_fn(ours(tokens[:, :-1]), tokens)
        released = [g.weights.unsharded.is_storage_released() for u in _layer_units(ours) for g in u._fsdp_state.groups]
        loss.backward()  # (gradients not stepped: the weights compared below are from _train)
        registered = {type(p) for p in ours.parameters()}
        state = _full_state(ours)
        out[reshard_after_forward] = {
            "vs_single_process": _max_diff(state, ref),
            "vs_fsdp2": _max_diff(state, _full_state(theirs)),
            "released_after_forward": released,
            "registered_after_backward": sorted(t.__name__ for t in registered),
        }
    return out


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("how", ["hf4_before", "hf4_after", "hf5_before", "hf5_after", "wrapper_before", "wrapper_after"])
def test_checkpointed_layers_train_like_one_process_and_fsdp2(how: str, reentrant: bool) -> None:
    model, batches, ref = _model_and_reference()
    results = run_ranks(_train_setups, 2, model, batches, ref, how, reentrant)
    for reshard_after_forward, r in results[0].items():
        print(how, reentrant, reshard_after_forward, r)
        assert r["vs_single_process"] <= TOLERANCE, r
        assert r["vs_fsdp2"] <= TOLERANCE, r
        assert all(r["released_after_forward"]) == reshard_after_forward, r
        assert r["released_after_forward"], r  # the layers are units
        # outside forward/backward the sharded DTensor parameters are registered again
        assert all("DTensor" in name for name in r["registered_after_backward"]), r
    assert results[0] == results[1]  # every rank holds the same full weights


def _train_double_forward(model: nn.Module, batches, rank: int = 0, world: int = 1) -> None:
    """Two forwards before one backward (DPO's pattern): each unit's backward and recomputation
    run twice in one backward."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    per = BATCH // world
    for tokens in batches:
        # two global batches (the second: the rows reversed), each rank its own rows of both
        first, second = tokens[rank * per : (rank + 1) * per], tokens.flip(0)[rank * per : (rank + 1) * per]
        chosen = loss_fn(model(first[:, :-1]), first)
        rejected = loss_fn(model(second[:, :-1]), second)
        (chosen - 0.5 * rejected).backward()
        opt.step()
        opt.zero_grad()


def _double_forward(model, batches, ref, how: str, reentrant: bool) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    ours = _checkpointed(copy.deepcopy(model), how, reentrant, fsdp.fully_shard, True)
    _train_double_forward(ours, batches, rank, world)
    return _max_diff(_full_state(ours), ref)


@pytest.mark.parametrize(
    "how,reentrant", [("hf4_after", False), ("hf5_before", True), ("wrapper_before", False), ("wrapper_after", True)]
)
def test_two_forwards_before_backward_with_checkpointing(how: str, reentrant: bool) -> None:
    model, batches, _ = _model_and_reference()
    ref = copy.deepcopy(model)
    _train_double_forward(ref, batches)
    ref_state = _full_state(ref)
    diffs = run_ranks(_double_forward, 2, model, batches, ref_state, how, reentrant)
    assert max(diffs) <= TOLERANCE, diffs
