"""Padding report: how much a row-atomic DBuffer layout pads real models.

Run from the repository root::

    python3 tools/padding_report.py

Shapes come from the public model configs in Hugging Face registration order
(``tests/models/shapes.py``; layout order is registration order). Mixtral uses
per-expert weights; "Mixtral-8x7B-stacked" stacks each into ``[E, ...]`` to show
why that hurts: a row becomes a whole expert matrix (58.7M elements), larger
than a shard at high world sizes.
"""

from __future__ import annotations

import os
import sys
import time

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dbuffer.layout import choose_layout, compute_layout, compute_ragged_layout  # noqa: E402
from tests.models.shapes import MODELS, model_shapes, unit_shapes  # noqa: E402

WORLD_SIZES = tuple(2**k for k in range(3, 11))  # 8 .. 1024


def unit_report(models: tuple[str, ...] = MODELS, world_sizes: tuple[int, ...] = WORLD_SIZES) -> str:
    """Padding of the per-unit layouts fsdp builds (each block and the root: one buffer each),
    row-atomic vs element-granular (ragged) vs :func:`choose_layout`'s pick at 0.1%."""
    lines = [f"{'model (per unit)':<22}{'world':>6}{'row-atomic %':>14}{'ragged %':>12}{'chosen %':>11}{'ragged units':>14}"]
    for name in models:
        units = unit_shapes(name)
        for n in world_sizes:
            data = sum(compute_layout(u, 1).data_numel for u in units)
            packed = sum(compute_layout(u, n).total_numel for u in units)
            ragged = sum(compute_ragged_layout(u, n).total_numel for u in units)
            chosen = [choose_layout(u, n) for u in units]
            picked = sum(c.total_numel for c in chosen)
            n_ragged = sum(type(c).__name__ == "RaggedLayout" for c in chosen)
            pct = lambda total: 100 * (total - data) / total  # noqa: E731
            lines.append(
                f"{name:<22}{n:>6}{pct(packed):>13.4f}%{pct(ragged):>11.6f}%{pct(picked):>10.4f}%"
                f"{f'{n_ragged}/{len(units)}':>14}"
            )
    return "\n".join(lines)


def report(models: tuple[str, ...] = MODELS, world_sizes: tuple[int, ...] = WORLD_SIZES) -> str:
    """The padding table as text."""
    lines = [f"{'model':<22}{'world':>6}{'params':>16}{'padding %':>11}{'padded elems':>16}{'layout ms':>11}"]
    for name in models:
        shapes = model_shapes(name)
        for n in world_sizes:
            start = time.perf_counter()
            layout = compute_layout(shapes, n)
            ms = (time.perf_counter() - start) * 1e3
            lines.append(
                f"{name:<22}{n:>6}{layout.data_numel:>16,}{100 * layout.padding_fraction:>10.4f}%"
                f"{layout.padding_numel:>16,}{ms:>11.1f}"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    print("one buffer for the whole model:")
    print(report())
    print("\none buffer per fully_shard unit (each layer, then the root), as fsdp builds them:")
    print(unit_report())
