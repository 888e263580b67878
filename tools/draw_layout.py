"""Draw a row-atomic DBuffer layout: which tensor holds which range of which rank.

Run from the repository root (needs matplotlib: ``pip install -e .[pictures]``)::

    python3 tools/draw_layout.py --model Llama-3-8B --world 8 --layers 2 --out layout.png
    python3 tools/draw_layout.py --model Llama-3-70B --world 64 --tp 8 --layers 1 --out tp.png
    python3 tools/draw_layout.py --shapes "[(4, 3), (5,), (7, 2)]" --world 4 --out small.png

One horizontal bar per rank (rank 0 on top) spans that rank's shard, ``shard_numel``
elements. Each tensor's piece is a segment colored by the tensor's shape (tensors of equal shape
share a color; thin white lines separate neighbours) and the larger ones are labelled ``#index``
(registration order). Padding is grey and hatched; padding too narrow to see at the figure's
scale is also marked by a red tick above the bar. ``--layers N`` keeps a model's embedding, its
first N layers, final norm and head, so that a 32-layer model still gives a readable picture.

``--tp T`` (with ``--model``) draws what one tensor-parallel rank lays out over its data-parallel
group: each weight is replaced by TP rank ``--tp-rank``'s ``torch.chunk`` piece under the Llama TP
plan of ``tools/tp_plan.py`` (column-parallel q/k/v/gate/up/w1/w3 and lm_head, row-parallel
o/down/w2 and the embedding; norms and the router replicated), and the pieces are laid out over
``world / T`` shards. Every TP rank's picture has the same structure; only uneven splits (e.g. a
vocabulary not divisible by ``T``) differ between them.

:func:`segments` is the pure part (no matplotlib): it cuts each rank's range into tensor pieces
and padding.
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
from typing import Optional, Sequence

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dbuffer.layout import Layout, compute_layout  # noqa: E402
from tests.models.shapes import MODELS, model_shapes, model_tp_dims  # noqa: E402
from tools.tp_plan import local_shape  # noqa: E402

Shape = tuple[int, ...]
Segment = tuple[int, int, Optional[int]]  # global [start, end), item index or None for padding

INSTALL_HINT = "draw_layout.py needs matplotlib, an optional dependency: pip install -e .[pictures]"


def segments(layout: Layout, num_shards: Optional[int] = None) -> list[list[Segment]]:
    """For each shard (rank), its range cut into ``(start, end, item)`` pieces, in order.

    Coordinates are global buffer offsets; rank ``k``'s pieces tile ``layout.shard_range(k, n)``
    exactly. ``item`` is the tensor's index in ``layout.items`` or ``None`` for padding. Every
    piece is non-empty, two padding pieces are never adjacent, and tensors with no elements
    appear nowhere. ``num_shards`` must divide ``layout.num_shards`` (default: equal to it).
    """
    n = layout.num_shards if num_shards is None else num_shards
    ranges = [layout.shard_range(k, n) for k in range(n)]
    pieces: list[list[Segment]] = [[] for _ in range(n)]
    for i, item in enumerate(layout.items):
        if item.numel == 0:
            continue
        for k in layout.owners(i, n):
            lo, hi = ranges[k]
            pieces[k].append((max(item.offset, lo), min(item.offset + item.numel, hi), i))
    out: list[list[Segment]] = []
    for (lo, hi), mine in zip(ranges, pieces):
        row: list[Segment] = []
        pos = lo
        for start, end, i in mine:  # items are placed in order, so pieces come sorted
            if start > pos:
                row.append((pos, start, None))
            row.append((start, end, i))
            pos = end
        if hi > pos:
            row.append((pos, hi, None))
        out.append(row)
    return out


def truncate_layers(shapes: Sequence[Shape], layers: int) -> list[Shape]:
    """Keep the first ``layers`` layers of ``embedding + L identical layers + norm + head``.

    The layer length is the shortest period of the middle part; raises ValueError if the
    shapes do not have that structure or have fewer than ``layers`` layers.
    """
    middle = list(shapes[1:-2])
    for period in range(1, len(middle) + 1):
        if len(middle) % period == 0 and all(middle[j] == middle[j + period] for j in range(len(middle) - period)):
            break
    else:
        raise ValueError("--layers needs a model made of an embedding, repeated layers, a norm and a head")
    count = len(middle) // period
    if not 1 <= layers <= count:
        raise ValueError(f"--layers must be between 1 and {count} for this model, got {layers}")
    return [tuple(shapes[0])] + middle[: layers * period] + [tuple(s) for s in shapes[-2:]]


def tp_shapes(name: str, tp: int, tp_rank: int = 0) -> list[Shape]:
    """``name``'s shapes as TP rank ``tp_rank`` of ``tp`` holds them (see the module docstring)."""
    if not 0 <= tp_rank < tp:
        raise ValueError(f"--tp-rank must be in [0, {tp}), got {tp_rank}")
    return [local_shape(s, d, tp, tp_rank) for s, d in zip(model_shapes(name), model_tp_dims(name))]


def parse_shapes(text: str) -> list[Shape]:
    """``"[(4, 3), (5,), 7]"`` -> ``[(4, 3), (5,), (7,)]`` (a bare int is a 1-D shape)."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise ValueError(
            f"--shapes must be a Python list of tuples of ints, e.g. \"[(4, 3), (5,)]\"; got {text!r}"
        ) from None
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"--shapes must be a list of shapes, got {value!r}")
    shapes: list[Shape] = []
    for s in value:
        dims = (s,) if isinstance(s, int) else s
        if not isinstance(dims, (list, tuple)) or not all(isinstance(d, int) and d >= 0 for d in dims):
            raise ValueError(f"each shape must be a tuple of non-negative ints, got {s!r}")
        shapes.append(tuple(dims))
    return shapes


def draw(layout: Layout, out: str, *, title: str = "", num_shards: Optional[int] = None) -> None:
    """Write the picture of ``layout`` cut into ``num_shards`` shards as a PNG at ``out``."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(INSTALL_HINT) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    n = layout.num_shards if num_shards is None else num_shards
    rows = segments(layout, n)
    size = layout.shard_numel_for(n)
    palette = plt.get_cmap("tab20").colors
    colors: dict[Shape, tuple] = {}  # first-seen order, so the legend follows the model
    for it in layout.items:
        if it.numel and it.shape not in colors:
            j = len(colors)  # dark tab20 shades first, then the light ones
            colors[it.shape] = palette[(2 * j) % 20 + (j // 10) % 2]
    unit, unit_name = _unit(size)

    fig, ax = plt.subplots(figsize=(14, 1.6 + 0.45 * min(n, 64)))
    tiny = 0.002 * size  # narrower than about a pixel column
    for k, row in enumerate(rows):
        base = k * size
        for start, end, item in row:
            x, w = (start - base) / unit, (end - start) / unit
            if item is None:
                ax.barh(k, w, left=x, height=0.7, color="0.82", hatch="////", edgecolor="0.45", linewidth=0)
                if end - start < tiny:
                    ax.plot([x + w / 2], [k - 0.46], marker="v", color="red", markersize=5, clip_on=False)
                continue
            ax.barh(k, w, left=x, height=0.7, color=colors[layout.items[item].shape], edgecolor="white", linewidth=0.6)
            if end - start >= 0.035 * size:
                ax.text(x + w / 2, k, f"#{item}", ha="center", va="center", fontsize=7)
    ax.set_ylim(n - 0.5, -0.5)
    ax.set_xlim(0, size / unit)
    if n <= 64:
        ax.set_yticks(range(n), [f"rank {k}" for k in range(n)])
    ax.set_ylabel("rank")
    ax.set_xlabel(f"offset in the rank's shard ({unit_name}elements; shard = {size:,} elements)")
    ax.set_title(
        (title + "\n" if title else "")
        + f"{len(layout.items)} tensors, {n} shards, padding {layout.padding_numel:,} elements "
        f"({100 * layout.padding_fraction:.4f}%)",
        fontsize=10,
    )
    handles = [Patch(color=c, label=f"shape {tuple(s)}") for s, c in list(colors.items())[:20]]
    if len(colors) > 20:
        handles.append(Patch(color="white", label=f"... {len(colors) - 20} more shapes"))
    handles.append(Patch(facecolor="0.82", hatch="////", edgecolor="0.45", label="padding"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    plt.close(fig)


def _unit(size: int) -> tuple[float, str]:
    for unit, name in ((1e9, "billions of "), (1e6, "millions of "), (1e3, "thousands of ")):
        if size >= 10 * unit:
            return unit, name
    return 1.0, ""


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="Draw which tensor occupies which range of which rank.")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", choices=MODELS, default=None, help="real model shapes (default Llama-3-8B)")
    source.add_argument("--shapes", help='custom shapes in registration order, e.g. "[(4, 3), (5,)]"')
    parser.add_argument("--world", type=int, default=8, help="number of shards (ranks), default 8")
    parser.add_argument("--layers", type=int, help="with --model: keep only its first N layers")
    parser.add_argument("--tp", type=int, default=1, help="with --model: tensor-parallel size (world = dp * tp)")
    parser.add_argument("--tp-rank", type=int, default=0, help="with --tp: which TP rank's pieces to draw")
    parser.add_argument("--out", default="layout.png", help="PNG to write (default layout.png)")
    args = parser.parse_args(argv)
    if args.world < 1:
        parser.error(f"--world must be >= 1, got {args.world}")
    if args.tp < 1 or args.world % args.tp:
        parser.error(f"--tp must be >= 1 and divide --world ({args.world}), got {args.tp}")
    shards = args.world // args.tp
    try:
        if args.shapes is not None:
            if args.layers is not None or args.tp > 1:
                parser.error("--layers and --tp apply to --model, not to --shapes")
            shapes, title = parse_shapes(args.shapes), "custom shapes"
        else:
            name = args.model or "Llama-3-8B"
            shapes, title = tp_shapes(name, args.tp, args.tp_rank), name
            if args.tp > 1:
                title += f", TP rank {args.tp_rank} of {args.tp} (Llama TP plan), dp {shards}"
            if args.layers is not None:
                shapes = truncate_layers(shapes, args.layers)
                title += f", first {args.layers} layers" if args.layers > 1 else ", first layer only"
    except ValueError as e:
        parser.error(str(e))
    try:
        import matplotlib  # noqa: F401  (check before the layout work)
    except ImportError:
        print(INSTALL_HINT, file=sys.stderr)
        return 1
    layout = compute_layout(shapes, shards)
    draw(layout, args.out, title=title)
    mesh = f"world {args.world}" + (f" = dp {shards} x tp {args.tp}" if args.tp > 1 else "")
    print(f"wrote {args.out}: {len(shapes)} tensors, {mesh}, shard {layout.shard_numel:,} elements, "
          f"padding {layout.padding_numel:,} ({100 * layout.padding_fraction:.4f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
