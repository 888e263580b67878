"""torch.compile of sharded units: fsdp's hooks run outside the compiled region.

``layer.compile()`` (or ``torch.compile(layer)`` in the layer's place) after ``fully_shard(layer)``
compiles ``nn.Module._call_impl``, which runs the
unit's forward hooks. Traced, their gathers, waits and storage resizes would each break the graph;
fsdp marks them (as FSDP2 marks its own) so that dynamo calls them eagerly and compiles each
layer's ``forward`` into one graph, reused by every layer and every step. The numbers must be
those of eager execution.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp
from tests.harness import run_ranks
from tests.models.llama import Llama, LlamaConfig, loss_fn

CONFIG = LlamaConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, hidden_dim=24, max_seq_len=8)
STEPS, BATCH, SEQ = 2, 4, 8


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ + 1), generator=g) for _ in range(STEPS)]


def _train(model: nn.Module, batches, rank: int = 0, world: int = 1) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    per, losses = BATCH // world, []
    for tokens in batches:
        tokens = tokens[rank * per : (rank + 1) * per]
        loss = loss_fn(model(tokens[:, :-1]), tokens)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full parameters by name (without the ``_orig_mod.`` of a ``torch.compile`` wrapper)."""
    return {
        n.replace("_orig_mod.", ""): (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in model.named_parameters()
    }


def _compiled_vs_eager(model: nn.Module, batches, how: str) -> dict:
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter
    from torch._dynamo.utils import counters

    rank, world = dist.get_rank(), dist.get_world_size()
    torch._dynamo.reset()
    counters.clear()
    compiled, eager = copy.deepcopy(model), copy.deepcopy(model)
    counter = CompileCounter()  # counts the graphs dynamo hands the backend, runs them eagerly
    for k, layer in enumerate(compiled.layers):
        fsdp.fully_shard(layer)
        if how == "module.compile":
            layer.compile(backend=counter)
        else:  # torch.compile(layer): a wrapper module in the layer's place
            compiled.layers[k] = torch.compile(layer, backend=counter)
    fsdp.fully_shard(compiled)
    for layer in eager.layers:
        fsdp.fully_shard(layer)
    fsdp.fully_shard(eager)
    try:
        compiled_losses = _train(compiled, batches, rank, world)
        breaks = {reason.splitlines()[0]: n for reason, n in counters["graph_break"].items()}
        frames, ops = counter.frame_count, counter.op_count
    finally:
        torch._dynamo.reset()
    eager_losses = _train(eager, batches, rank, world)
    a, b = _full_state(compiled), _full_state(eager)
    return {
        "graph_breaks": breaks,
        "frames": frames,
        "ops": ops,
        "losses": (compiled_losses, eager_losses),
        "weights_equal": all(torch.equal(a[k], b[k]) for k in a),
        "state": a,
    }


@pytest.mark.parametrize("how", ["module.compile", "torch.compile"])
def test_compiled_layers_have_no_graph_break_and_train_as_eager(how: str) -> None:
    torch.manual_seed(0)
    model, batches = Llama(CONFIG), _batches()
    reference = copy.deepcopy(model)
    _train(reference, batches)  # one process, the global batch
    ref_state = _full_state(reference)
    results = run_ranks(_compiled_vs_eager, 2, model, batches, how, timeout=300)
    for r in results:
        assert r["graph_breaks"] == {}, r["graph_breaks"]
        # one graph: each layer's forward, compiled once and reused by the other layer and the
        # next step (the hooks register the same unsharded parameters every time)
        assert r["frames"] == 1 and r["ops"] > 0, (r["frames"], r["ops"])
        compiled_losses, eager_losses = r["losses"]
        assert compiled_losses == eager_losses  # bitwise: the same ATen ops run
        assert r["weights_equal"]
        diff = max(float((r["state"][k] - ref_state[k]).abs().max()) for k in ref_state)
        assert diff <= 1e-6, diff
