"""Properties of fsdp.megatron's GlobalLayout (Megatron-FSDP's packing): every tensor on rows of
its own, no overlap, shards whole multiples of the LCM granule (so no boundary of any coarser
sharding cuts a row), gaps filled (never larger than placing each tensor on its own granule), and
dbuffer's row queries agreeing with the offsets."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dbuffer import compute_layout
from fsdp.megatron import GlobalLayout

_dim = st.integers(1, 6)
shapes_st = st.lists(
    st.one_of(st.tuples(st.integers(0, 9)), st.tuples(st.integers(0, 9), _dim), st.tuples(st.integers(0, 5), _dim, _dim)),
    min_size=1,
    max_size=8,
)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@given(shapes_st, st.integers(1, 8))
def test_tensors_sit_on_whole_rows_of_granule_aligned_shards(shapes, dp) -> None:
    layout = GlobalLayout.build(shapes, dp)
    rows = [math.prod(s[1:]) for s in shapes]
    chunk = math.lcm(*rows)
    numels = [math.prod(s) for s in shapes]
    assert layout.tensor_shapes == tuple(torch.Size(s) for s in shapes)
    assert layout.size % (chunk * dp) == 0 and layout.num_shards == dp and layout.shard_numel * dp == layout.size
    spans = sorted((o, o + n) for o, n in zip(layout.tensor_to_offset, numels) if n)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:])), "tensors overlap"
    for offset, numel, row in zip(layout.tensor_to_offset, numels, rows):
        assert offset % row == 0 and 0 <= offset and offset + numel <= layout.size
    for n in _divisors(dp) if layout.size else ():  # every coarser sharding: no boundary inside a row
        width = layout.size // n
        for k, (offset, numel, row) in enumerate(zip(layout.tensor_to_offset, numels, rows)):
            for b in range(width, layout.size, width):
                assert not (offset < b < offset + numel) or (b - offset) % row == 0
            counts = layout.rows_per_shard(k, n)
            assert sum(counts) == shapes[k][0]


@given(shapes_st, st.integers(1, 8))
def test_gaps_are_filled_never_worse_than_a_granule_per_tensor(shapes, dp) -> None:
    layout = GlobalLayout.build(shapes, dp)
    chunk = math.lcm(*[math.prod(s[1:]) for s in shapes])
    one_each = sum(-(-math.prod(s) // chunk) * chunk for s in shapes)
    assert layout.size <= -(-max(one_each, 1) // (chunk * dp)) * chunk * dp


def test_a_fragment_fills_the_gap_a_regular_tensor_leaves() -> None:
    # granule lcm(4, 6, 1) = 12: (5, 4) leaves 4 elements before the next granule, and (3,) fits there
    layout = GlobalLayout.build([(5, 4), (2, 6), (3,)], 2)
    offsets = layout.tensor_to_offset
    assert offsets[0] == 0 and offsets[2] == 20 and offsets[1] % 12 == 0 and offsets[1] >= 24


def test_names_of_a_dbuffer_layout() -> None:
    shapes = [(5, 4), (3,), (7, 2)]
    packed = compute_layout(shapes, 4)
    named = GlobalLayout.of(packed)
    assert named.tensor_to_offset == tuple(i.offset for i in packed.items)
    assert named.size == packed.total_numel and named.tensor_shapes == tuple(torch.Size(s) for s in shapes)
    assert named.item_rows(0, 1) == packed.item_rows(0, 1)


@pytest.mark.parametrize("shape", [(), (3, 0)])
def test_shapes_megatron_fsdp_cannot_lay_out_raise(shape) -> None:
    with pytest.raises(ValueError, match="0-D|rows"):
        GlobalLayout.build([(4, 4), shape], 2)
