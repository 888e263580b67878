"""Meta-device init: build under torch.device("meta"), fully_shard, materialise only local shards.

* On 2 gloo ranks, every strategy: ``to_empty`` + ``init_weights`` gives bit for bit the weights of
  the same model built eagerly with the same seed, and training then matches the eagerly built
  fsdp model bit for bit; as in FSDP2 the parameters stay on meta until ``to_empty`` and running
  before it raises FSDP2's error; ``reset_parameters()`` on the sharded modules initialises every
  value; loading a checkpoint instead of initialising works, and so does
  ``load_state_dict(sharded_sd, assign=True)`` (the assigned DTensors become the parameters).
* On a fake world of 64, three ranks in turn: a memory tracker sees every tensor allocated from
  building the model on meta to the end of ``init_weights``; the peak of live bytes stays below
  1/8 of the model (one block and the root's own weights in full, plus the rank's shards), and the rank's rows equal those of
  the eager build.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import fsdp
from dbuffer.dtensor import row_range
from fsdp import checkpoint as ckpt
from tests.fsdp.models import RMSNorm, TinyLM, full_state, loss_fn, make_batches, make_model, train
from tests.fsdp.test_parity import STRATEGIES, shard
from tests.harness import run_ranks


def _init(m: nn.Module) -> None:
    """The eager construction of TinyLM as a per-module init (RMSNorm has no reset_parameters)."""
    if isinstance(m, RMSNorm):
        nn.init.ones_(m.weight)
    elif isinstance(m, (nn.Linear, nn.Embedding)):
        m.reset_parameters()


def _meta_model(seed: int, strategy: str):
    torch.manual_seed(seed)
    with torch.device("meta"):
        m = TinyLM()
    assert all(p.is_meta for p in m.parameters())
    return shard(m, True, sharding_strategy=strategy)


def _meta_vs_eager(model, batches, path: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = batches[0]
    out = {}
    for strategy in STRATEGIES:
        m = _meta_model(0, strategy)
        # As in FSDP2: the sharded parameters stay on meta until to_empty.
        assert all(isinstance(p, DTensor) and p.is_meta for p in m.parameters())
        with pytest.raises(RuntimeError, match="should be materialized from meta device.*'embed.weight'"):
            loss_fn(m, x, y)
        with pytest.raises(RuntimeError, match="should be materialized from meta device"):
            m.unshard()  # an explicit unshard: the same error, before any collective
        with pytest.raises(ValueError, match="pass a cpu device"):
            m.to_empty(device="cuda")  # another device type than the mesh's: refused, nothing allocated
        assert all(p.is_meta for p in m.parameters())
        params = list(m.parameters())
        m.to_empty(device="cpu")
        assert [id(p) for p in m.parameters()] == [id(p) for p in params]  # identity kept
        assert all(not p.is_meta for p in m.parameters())
        torch.manual_seed(0)  # the stream an eager build starts from
        fsdp.init_weights(m, _init)
        weights = full_state(m)
        eager = shard(copy.deepcopy(model), True, sharding_strategy=strategy)
        train(m, batches, rank=rank, world=world)
        train(eager, batches, rank=rank, world=world)
        out[strategy] = (weights, _equal(full_state(m), full_state(eager)))
    # FSDP2's flow: to_empty, then each module's own init on the *sharded* model. Random fills
    # follow DTensor's rules per parameter (fsdp/README.md, "Meta-device init"), so only
    # fsdp.init_weights promises the eager weights; here every value must be written and training
    # must run.
    m = _meta_model(0, "optim_grads_params")
    m.to_empty(device="cpu")
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(1337.0)
    for module in m.modules():
        _init(module)
    out["reset_parameters"] = all(bool((p.full_tensor() != 1337.0).all()) for p in m.parameters())
    train(m, batches, rank=rank, world=world)
    # A meta-built model that loads a checkpoint needs no init.
    eager = shard(copy.deepcopy(model), True)
    ckpt.save({"model": eager.state_dict()}, path)
    m = _meta_model(5, "optim_grads")
    m.to_empty(device="cpu")
    state = {"model": m.state_dict()}
    ckpt.load(state, path)
    m.load_state_dict(state["model"])
    with torch.no_grad():
        out["loaded"] = torch.equal(loss_fn(m, x, y), loss_fn(eager, x, y))
    # load_state_dict(assign=True) of sharded DTensors on a meta model (FSDP2's rank-0 broadcast
    # recipe): the assigned objects become the model's parameters, in fsdp's layout.
    m = _meta_model(5, "optim_grads_params")
    sd = {k: nn.Parameter(v.detach().clone()) for k, v in eager.state_dict().items()}
    m.load_state_dict(sd, assign=True)
    assert all(a is b for a, b in zip(m.parameters(), sd.values()))
    with torch.no_grad():
        out["assigned"] = torch.equal(loss_fn(m, x, y), loss_fn(eager, x, y))
    return out


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_meta_init_equals_the_eager_build_for_every_strategy(tmp_path) -> None:
    model, batches = make_model(), make_batches(3)
    eager = full_state(model)
    results = run_ranks(_meta_vs_eager, 2, model, batches, str(tmp_path / "ck"))
    for rank_result in results:
        assert rank_result.pop("loaded")
        assert rank_result.pop("assigned")
        assert rank_result.pop("reset_parameters")
        for strategy, (weights, trains_alike) in rank_result.items():
            assert _equal(weights, eager), strategy
            assert trains_alike, strategy


# ----------------------------------------------------------------------------- memory, world 64

WORLD, BLOCKS, WIDTH, VOCAB = 64, 32, 128, 64


class Deep(nn.Module):
    """32 residual MLP blocks, each about 1/32 of the weights; the root's own (embedding, head)
    are 1/130."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))
            for _ in range(BLOCKS)
        )
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


class LiveBytes(TorchDispatchMode):
    """Peak bytes of CPU storages allocated under this mode that are alive at the same time.

    Every op's outputs (local pieces of DTensors included) are recorded by storage; after each op
    the current size of every recorded storage still alive is summed, so storage freed with
    ``release_storage()`` counts 0 and reallocated storage counts again.
    """

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, StorageWeakRef] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, DTensor):
                t = t._local_tensor
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                self.refs.setdefault(storage._cdata, StorageWeakRef(storage))
        self.peak = max(self.peak, self.live())
        return out

    def live(self) -> int:
        total = 0
        for key, ref in list(self.refs.items()):
            storage = None if ref.expired() else torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
            if storage is None:
                del self.refs[key]
            else:
                total += storage.nbytes()
        return total


@pytest.mark.parametrize("rank", [0, 37, WORLD - 1])
def test_no_rank_ever_holds_the_full_model_world_64(rank) -> None:
    torch.manual_seed(0)
    eager = Deep()
    expected = {n: p.detach().clone() for n, p in eager.named_parameters()}
    full_bytes = sum(t.numel() * t.element_size() for t in expected.values())
    result = run_ranks(_materialise, WORLD, expected, backend="fake", fake_rank=rank)[0]
    print(
        f"rank {rank}/{WORLD}: model {full_bytes / 2**10:.0f} KiB, rank's shards {result['held'] / 2**10:.0f} KiB, "
        f"peak live while building and materialising {result['peak'] / 2**10:.0f} KiB "
        f"= {result['peak'] / full_bytes:.3f} of the model"
    )
    assert result["rank"] == rank and result["rows_match"]
    assert 0 < result["held"] < result["peak"] < full_bytes / 8


def _materialise(expected: dict) -> dict:
    """Build on meta, shard and materialise, all tracked; then check this rank's rows."""
    with LiveBytes() as tracker:
        torch.manual_seed(0)
        with torch.device("meta"):
            model = Deep()
        for block in model.blocks:
            fsdp.fully_shard(block)
        fsdp.fully_shard(model)
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        fsdp.init_weights(model)  # reset_parameters() of each module, one unit at a time
    # Nothing is communicated while materialising, so even on a fake group the rows are real.
    rows_match = all(
        torch.equal(p._local_tensor, expected[name][slice(*row_range(p))]) for name, p in model.named_parameters()
    )
    held = sum(p._local_tensor.numel() * 4 for p in model.parameters())
    return {"rank": dist.get_rank(), "peak": tracker.peak, "rows_match": rows_match, "held": held}
