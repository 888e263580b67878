"""Communication of Muon on ``Owned()`` parameters against Muon on row-sharded (ZeRO-3) ones.

    python3 tools/bench_muon.py                 # the table, then a measured step on 2 gloo ranks
    python3 tools/bench_muon.py --no-measure    # the table only (pure arithmetic, instant)

Muon's Newton–Schulz step needs each weight matrix whole. Two ways to get there:

* ``gather`` (naive sharded Muon): ZeRO-3 as usual (packed ``Shard(0)`` weights: reduce-scatter
  the gradients, all-gather the weights), plus an all-gather of every Muon matrix's momentum
  update so that every rank can run Newton–Schulz on every matrix and keep its own rows of the
  result: one more all-gather of all matrices per step, and ``world`` times the Newton–Schulz
  FLOPs in total (every rank runs all of them).
* ``owned`` (this repository: ``dbuffer.Owned()`` + :class:`fsdp.optim.muon.Muon`): each tensor lies
  whole on one owner; the gradient reduce-scatter lands each tensor's mean on its owner, the
  owner steps it alone, the weight all-gather brings it back. The same two collectives as
  ZeRO-3, no extra one; each matrix's Newton–Schulz runs once, on its owner.

Owned shards are padded to the largest owner's load, and the equal-shard collectives move the
padding, so owned wins only while no tensor outweighs a fair share (total / world): a big
embedding or output head makes every shard that big. ``owned split`` keeps only the Muon matrices
Owned and the rest (embedding, head, norms, biases: AdamW anyway) packed ``Shard(0)`` in a second
buffer. Beyond ``world ~ total / largest matrix`` even that pads; per-tensor broadcasts and
reductions (no padding) would be the next step.

Columns are bytes each rank *sends* per optimizer step with bandwidth-optimal algorithms
(all-gather and reduce-scatter: ``(world - 1) x shard``), fp32 (``--bytes`` to change), and the
Newton–Schulz FLOPs of the busiest rank (``ns_steps x (4 m^2 n + 2 m^3)`` per m x n matrix, m <=
n). Muon matrices: the 2-D parameters, except the first and last of a language model (embedding,
output head), which use AdamW as usual.

The measured part runs one warm-up and one counted step of both ways on 2 gloo ranks on a small
MLP, counts the c10d calls with ``tools.kit.comm.CommCounter`` and checks that both ways give
the same weights bit for bit (the same Muon, computed in different places).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from dbuffer import DBuffer  # noqa: E402
from dbuffer.layout import compute_layout, compute_owned_layout  # noqa: E402
from tools.kit import launch  # noqa: E402

Shape = tuple[int, ...]

TEST_MLP_SHAPES: list[Shape] = [(32, 12), (32,), (24, 32), (24,), (5, 24), (5,)]  # tests/fsdp/test_muon.py
MEASURED_MLP = (64, 128, 128, 128, 64)  # layer widths of the MLP measured on gloo (--mlp)


def mlp_shapes(widths: Sequence[int]) -> list[Shape]:
    """Weight and bias shapes of an MLP with these layer widths, in registration order."""
    shapes: list[Shape] = []
    for fan_in, fan_out in zip(widths, widths[1:]):
        shapes += [(fan_out, fan_in), (fan_out,)]
    return shapes


def ns_flops(shape: Shape, ns_steps: int = 5) -> int:
    """FLOPs of :func:`fsdp.optim.muon.newton_schulz` on one matrix: per iteration, the Gram matrix
    (2 m^2 n), its square (2 m^3) and the product with X (2 m^2 n), with m <= n."""
    m, n = sorted(shape)
    return ns_steps * (4 * m * m * n + 2 * m**3)


def lm_muon_mask(shapes: Sequence[Shape]) -> list[bool]:
    """Muon matrices of a language model: 2-D, except the first (embedding) and last (head)."""
    return [len(s) == 2 and 0 < i < len(shapes) - 1 for i, s in enumerate(shapes)]


@dataclass
class CommRow:
    model: str
    world: int
    params: int
    zero3: float  # bytes sent per rank per step: ZeRO-3 with AdamW (reference)
    gather: float  # ZeRO-3 + all-gather of every Muon matrix
    owned: float  # every tensor Owned
    owned_split: float  # Muon matrices Owned, the rest packed Shard(0)
    owned_padding: float  # padding fraction of the all-Owned layout
    ns_gather: int  # Newton–Schulz FLOPs per rank, naive: every matrix on every rank
    ns_owned: int  # busiest owner's Newton–Schulz FLOPs (all-Owned layout)
    ns_total: int


def muon_comm(
    model: str,
    shapes: Sequence[Shape],
    world: int,
    muon_mask: Optional[Sequence[bool]] = None,
    elem_bytes: int = 4,
    ns_steps: int = 5,
) -> CommRow:
    """Bytes each rank sends per step and Newton–Schulz FLOPs, for the four ways above."""
    shapes = [tuple(s) for s in shapes]
    mask = list(muon_mask) if muon_mask is not None else [len(s) == 2 for s in shapes]
    matrices = [s for s, m in zip(shapes, mask) if m]
    rest = [s for s, m in zip(shapes, mask) if not m]
    w1 = world - 1

    def packed(ss: Sequence[Shape]) -> int:
        return compute_layout(ss, world).shard_numel if ss else 0

    def owned(ss: Sequence[Shape]) -> int:
        """Elements a rank sends for an Owned buffer, reduction to the owners plus gather: padded
        shards (reduce-scatter + all-gather), or, when those are mostly padding, only each
        owner's tensors (an all-to-all of unequal splits + broadcasts; bandwidth-optimal like
        the rest: a rank sends about ``(W - 1) / W`` of the data each way)."""
        if not ss:
            return 0
        layout = compute_owned_layout(ss, world)
        if world * layout.shard_numel > DBuffer._OWNED_BROADCAST_ABOVE * layout.data_numel:
            return 2 * (layout.data_numel * w1 // world)
        return 2 * w1 * layout.shard_numel

    owned_all = compute_owned_layout(shapes, world)
    zero3 = 2 * w1 * packed(shapes)
    ns_per_rank = [0] * world
    for i, (s, m) in enumerate(zip(shapes, mask)):
        if m:
            ns_per_rank[owned_all.owner(i)] += ns_flops(s, ns_steps)
    return CommRow(
        model=model,
        world=world,
        params=owned_all.data_numel,
        zero3=zero3 * elem_bytes,
        gather=(zero3 + w1 * packed(matrices)) * elem_bytes,
        owned=owned(shapes) * elem_bytes,
        owned_split=(owned(matrices) + 2 * w1 * packed(rest)) * elem_bytes,
        owned_padding=owned_all.padding_fraction,
        ns_gather=sum(ns_per_rank),
        ns_owned=max(ns_per_rank),
        ns_total=sum(ns_per_rank),
    )


def _size(nbytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


def _flops(f: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if f >= scale:
            return f"{f / scale:.2f} {unit}"
    return f"{f:.0f}"


def format_table(rows: Sequence[CommRow]) -> str:
    head = (
        "| model | world | params | ZeRO-3 AdamW | gather Muon | owned Muon | owned/gather | owned pad "
        "| owned split | split/gather | NS FLOPs/rank gather | NS owned (busiest) | gather/owned NS |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r.model} | {r.world} | {r.params / 1e6:.2f}M | {_size(r.zero3)} | {_size(r.gather)} | "
            f"{_size(r.owned)} | {r.owned / r.gather:.2f} | {r.owned_padding:.1%} | {_size(r.owned_split)} | "
            f"{r.owned_split / r.gather:.2f} | {_flops(r.ns_gather)} | {_flops(r.ns_owned)} | "
            f"{r.ns_gather / max(r.ns_owned, 1):.1f}x |"
        )
    return "\n".join(lines)


def default_rows(elem_bytes: int = 4) -> list[CommRow]:
    import torch

    from tests.models.llama import Llama, LlamaConfig
    from tests.models.shapes import model_shapes

    with torch.device("meta"):
        small_llama = [tuple(p.shape) for p in Llama(LlamaConfig()).parameters()]
    llama8b = model_shapes("Llama-3-8B")
    rows = [muon_comm("test MLP", TEST_MLP_SHAPES, w, elem_bytes=elem_bytes) for w in (2, 4)]
    for widths in (MEASURED_MLP, (64, 256, 256, 16)):
        name = "MLP " + "-".join(map(str, widths))
        rows += [muon_comm(name, mlp_shapes(widths), w, elem_bytes=elem_bytes) for w in (2, 4)]
    rows += [
        muon_comm("tools.llama default", small_llama, w, lm_muon_mask(small_llama), elem_bytes) for w in (2, 8, 32)
    ]
    rows += [muon_comm("Llama-3-8B", llama8b, w, lm_muon_mask(llama8b), elem_bytes) for w in (8, 64, 256)]
    return rows


# ----------------------------------------------------------------------------- measured on gloo

HP = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.01, adamw_lr=1e-3, adamw_weight_decay=0.01)


def _init(shapes: Sequence[Shape]):
    import torch

    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g) / (s[-1] ** 0.5 if len(s) == 2 else 4.0) for s in shapes]


def _local_grads(compute, rank: int, world: int):
    """Forward/backward of this rank's slice of a fixed global batch (64 rows) through the MLP."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, compute[0].shape[1], generator=g)
    y = torch.sin(torch.randn(64, compute[-1].shape[0], generator=g))
    per = len(x) // world
    h = x[rank * per : (rank + 1) * per]
    for p in compute:
        p.grad = None
    for k in range(0, len(compute), 2):
        h = F.linear(h, compute[k], compute[k + 1])
        if k + 2 < len(compute):
            h = torch.tanh(h)
    F.mse_loss(h, y[rank * per : (rank + 1) * per]).backward()
    return [p.grad for p in compute]


def _gather_and_reduce(way, rank: int, world: int) -> None:
    """The part both ways share: all-gather the weights, backward on this rank's slice, reduce
    the gradients into the sharded (or owned) gradient buffer."""
    way.weights.allgather(0, out=way.full)
    for i, g in enumerate(_local_grads(way.compute, rank, world)):
        way.grads_partial.get_local_tensor(i).copy_(g)
    way.grads_partial.reduce_scatter(0, out=way.grads)


class _Owned:
    """Owned weights, a reused full buffer, Partial("avg") -> Owned gradients, fsdp.optim.muon.Muon."""

    def __init__(self, shapes, mesh) -> None:
        import torch
        from torch.distributed.tensor import Partial, Replicate

        from dbuffer import DBuffer, Owned, distribute_tensors
        from fsdp.optim.muon import Muon

        self.weights = distribute_tensors(_init(shapes), mesh, [Owned()])
        layout = self.weights.layout
        self.full = DBuffer(mesh, [Replicate()], shapes, torch.float32, layout=layout)
        self.grads_partial = DBuffer(mesh, [Partial("avg")], shapes, torch.float32, layout=layout)
        self.grads = DBuffer(mesh, [Owned()], shapes, torch.float32)
        main = [torch.nn.Parameter(self.weights.get_dtensor(i)) for i in range(len(shapes))]
        for i, p in enumerate(main):
            p.grad = self.grads.get_dtensor(i)
        self.opt = Muon(main, **HP)
        self.compute = [torch.nn.Parameter(self.full.get_local_tensor(i)) for i in range(len(shapes))]

    def step(self, rank: int, world: int) -> None:
        _gather_and_reduce(self, rank, world)
        self.opt.step()

    def final(self):
        self.weights.allgather(0, out=self.full)
        return [self.full.get_local_tensor(i).clone() for i in range(len(self.compute))]


class _Gather:
    """Naive sharded Muon: packed Shard(0) weights and gradients (ZeRO-3), momentum kept as row
    shards, the Nesterov update of every matrix all-gathered, Newton–Schulz of every matrix on
    every rank, each rank applying its own rows. AdamW (fsdp.optim.muon.Muon, use_muon=False) on the
    row pieces of the rest."""

    def __init__(self, shapes, mesh) -> None:
        import torch
        from torch.distributed.tensor import Partial, Replicate, Shard

        from dbuffer import DBuffer, distribute_tensors
        from fsdp.optim.muon import Muon

        self.shapes = shapes
        self.mats = [i for i, s in enumerate(shapes) if len(s) == 2]
        mat_shapes = [shapes[i] for i in self.mats]
        self.weights = distribute_tensors(_init(shapes), mesh, [Shard(0)])
        self.full = DBuffer(mesh, [Replicate()], shapes, torch.float32)
        self.grads_partial = DBuffer(mesh, [Partial("avg")], shapes, torch.float32)
        self.grads = DBuffer(mesh, [Shard(0)], shapes, torch.float32)
        self.momentum = DBuffer(mesh, [Shard(0)], mat_shapes, torch.float32)
        self.update = DBuffer(mesh, [Shard(0)], mat_shapes, torch.float32)
        self.update_full = DBuffer(mesh, [Replicate()], mat_shapes, torch.float32)
        rest = [i for i in range(len(shapes)) if i not in self.mats]
        self.rest = [torch.nn.Parameter(self.weights.get_dtensor(i)) for i in rest]
        for p, i in zip(self.rest, rest):
            p.grad = self.grads.get_dtensor(i)
        self.adamw = Muon([{"params": self.rest, "use_muon": False}], **HP)
        self.compute = [torch.nn.Parameter(self.full.get_local_tensor(i)) for i in range(len(shapes))]

    def step(self, rank: int, world: int) -> None:
        import torch

        from fsdp.optim.muon import newton_schulz

        _gather_and_reduce(self, rank, world)
        mu = HP["momentum"]
        for j, i in enumerate(self.mats):  # elementwise on row shards: no communication
            grad, buf = self.grads.get_local_tensor(i), self.momentum.get_local_tensor(j)
            buf.lerp_(grad, 1 - mu)
            self.update.get_local_tensor(j).copy_(torch.lerp(grad, buf, mu))
        self.update.allgather(0, out=self.update_full)  # the extra collective
        lr, wd = HP["lr"], HP["weight_decay"]
        for j, i in enumerate(self.mats):  # every rank runs every Newton–Schulz
            rows, cols = self.shapes[i]
            ortho = newton_schulz(self.update_full.get_local_tensor(j))
            r0, r1 = self.weights.local_rows(i)
            w = self.weights.get_local_tensor(i)
            w.mul_(1 - lr * wd)
            w.add_(ortho[r0:r1], alpha=-lr * math.sqrt(max(1.0, rows / cols)))
        self.adamw.step()

    final = _Owned.final


def measure(shapes: Sequence[Shape]) -> dict:
    """On every rank of the initialised default group: one warm-up and one counted step of both
    ways on the MLP of ``shapes``. Returns the counter's stats per way, the prediction of :func:`muon_comm`, and whether both
    ways ended with the same weights bit for bit."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from tools.kit.comm import CommCounter

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    counter = CommCounter()
    ways = {"owned": _Owned(shapes, mesh), "gather": _Gather(shapes, mesh)}
    for name, way in ways.items():
        way.step(rank, world)  # warm-up
        counter.install()
        try:
            with counter.counting(name):
                way.step(rank, world)
        finally:
            counter.uninstall()
    same = all(torch.equal(a, b) for a, b in zip(ways["owned"].final(), ways["gather"].final()))
    return {"stats": counter.stats, "predicted": muon_comm("measured", shapes, world), "same": same}


def _measure_and_print(shapes) -> None:
    """Every rank measures; rank 0 prints."""
    import torch.distributed as dist

    result = measure(shapes)
    if dist.get_rank() == 0:
        _print_measured(dist.get_world_size(), shapes, result)


def _print_measured(world: int, shapes, result: dict) -> None:
    """Rank 0's table of the measured step."""
    stats, predicted = result["stats"], result["predicted"]
    print(f"\nMeasured on {world} gloo ranks, MLP {list(shapes)}, one step after one warm-up (bytes rank 0 sends):\n")
    print("| way | collectives | bytes sent | predicted | by kind |")
    print("|---|---|---|---|---|")
    for name, expect in (("owned", predicted.owned), ("gather", predicted.gather)):
        s = stats[name]
        kinds = ", ".join(f"{k} {v['calls']}x {_size(v['bytes_sent'])}" for k, v in sorted(s["by_kind"].items()))
        print(f"| {name} | {s['ops']} | {_size(s['bytes_sent'])} | {_size(expect)} | {kinds} |")
    ratio = stats["owned"]["bytes_sent"] / stats["gather"]["bytes_sent"]
    print(f"owned / gather bytes: {ratio:.2f}; weights after 2 steps identical bit for bit: {result['same']}")


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-measure", action="store_true", help="print the computed table only")
    parser.add_argument("--bytes", type=int, default=4, help="bytes per element (4: fp32, 2: bf16)")
    parser.add_argument("--world", type=int, default=2, help="gloo ranks for the measured step")
    parser.add_argument(
        "--mlp", default=",".join(map(str, MEASURED_MLP)), help="layer widths of the measured MLP (default %(default)s)"
    )
    args = parser.parse_args(argv)
    print("Bytes each rank sends per optimizer step, and Newton–Schulz FLOPs per rank:\n")
    print(format_table(default_rows(args.bytes)))
    if args.no_measure:
        return
    widths = [int(w) for w in args.mlp.split(",")]
    if len(widths) < 2 or 64 % args.world:
        parser.error("--mlp needs at least two widths, and --world must divide the batch of 64 rows")
    launch.spawn(args.world, _measure_and_print, mlp_shapes(widths))


if __name__ == "__main__":
    main()
