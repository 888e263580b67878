"""Properties of dbuffer.placements: validation, the planner's step rules, and what a plan does to
the data, checked by simulating every rank of a small mesh symbolically. Pure: no process group."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard

from dbuffer.placements import Step, check_placements, num_shards, plan_redistribute, shard_index
from tests.hypothesis_profiles import examples

S, R, SUM, AVG = Shard(0), Replicate(), Partial("sum"), Partial("avg")
ALL = [S, R, SUM, AVG]
MESHES = {1: [(2,), (3,), (4,)], 2: [(2, 3), (3, 2), (2, 2), (1, 3)], 3: [(2, 2, 2), (2, 3, 2), (3, 1, 2)]}

SOURCE = {"allgather": Shard, "reduce_scatter": Partial, "scatter": Replicate, "allreduce": Partial}
TARGET = {"allgather": Replicate, "reduce_scatter": Shard, "scatter": Shard, "allreduce": Replicate}


# -- strategies -------------------------------------------------------------


@st.composite
def reachable_pair(draw):
    """(mesh_shape, src, dst) where dst has no Partial that src lacks on the same axis."""
    ndim = draw(st.integers(1, 3))
    mesh_shape = draw(st.sampled_from(MESHES[ndim]))
    src = draw(st.lists(st.sampled_from(ALL), min_size=ndim, max_size=ndim))
    dst = [draw(st.sampled_from([S, R, s] if isinstance(s, Partial) else [S, R])) for s in src]
    return mesh_shape, src, dst


@st.composite
def unreachable_pair(draw):
    """(src, dst) where some axis of dst is a Partial that src does not have there."""
    ndim = draw(st.integers(1, 3))
    src = draw(st.lists(st.sampled_from(ALL), min_size=ndim, max_size=ndim))
    dst = draw(st.lists(st.sampled_from(ALL), min_size=ndim, max_size=ndim))
    axis = draw(st.integers(0, ndim - 1))
    dst[axis] = draw(st.sampled_from([p for p in (SUM, AVG) if p != src[axis]]))
    return src, dst


# -- a symbolic mesh ---------------------------------------------------------


class Local:
    """What one rank holds: piece ``index`` of ``count`` equal pieces of (the sum of the
    contributions ``terms``) / ``divisor``. A contribution is named by the coordinates of the rank
    that made it, on the axes that were Partial in the source."""

    def __init__(self, index: int, count: int, terms: frozenset, divisor: int) -> None:
        self.index, self.count, self.terms, self.divisor = index, count, terms, divisor


def _coords(mesh_shape):
    return list(itertools.product(*[range(n) for n in mesh_shape]))


def _groups(mesh_shape, axis):
    """The coordinates of each group along ``axis``, ordered by their coordinate on it."""
    others = [range(n) if a != axis else [None] for a, n in enumerate(mesh_shape)]
    for fixed in itertools.product(*others):
        yield [tuple(j if a == axis else fixed[a] for a in range(len(mesh_shape))) for j in range(mesh_shape[axis])]


def _initial(mesh_shape, src):
    partial_axes = [a for a, p in enumerate(src) if isinstance(p, Partial)]
    return {
        c: Local(
            shard_index(mesh_shape, src, c),
            num_shards(mesh_shape, src),
            frozenset({tuple(c[a] for a in partial_axes)}),
            1,
        )
        for c in _coords(mesh_shape)
    }


def _apply(state, mesh_shape, before, step: Step):
    """Run ``step`` on every group along its axis, asserting it is legal for the data held."""
    m = mesh_shape[step.axis]
    new = {}
    for group in _groups(mesh_shape, step.axis):
        pieces = [state[c] for c in group]
        if step.kind == "allgather":
            first = pieces[0]
            assert first.index % m == 0, "gathered shards do not start a block"
            for j, p in enumerate(pieces):
                assert (p.index, p.count) == (first.index + j, first.count), "gathered shards not contiguous"
                assert (p.terms, p.divisor) == (first.terms, first.divisor), "gathering different values"
            for c in group:
                new[c] = Local(first.index // m, first.count // m, first.terms, first.divisor)
        elif step.kind == "scatter":
            for j, (c, p) in enumerate(zip(group, pieces)):
                new[c] = Local(p.index * m + j, p.count * m, p.terms, p.divisor)
        else:  # reduce_scatter / allreduce: sum disjoint contributions over one common piece
            first = pieces[0]
            assert all((p.index, p.count, p.divisor) == (first.index, first.count, first.divisor) for p in pieces)
            terms = frozenset().union(*(p.terms for p in pieces))
            assert len(terms) == sum(len(p.terms) for p in pieces), "a contribution would be counted twice"
            divisor = first.divisor * (m if before[step.axis] == AVG else 1)
            for j, c in enumerate(group):
                if step.kind == "allreduce":
                    new[c] = Local(first.index, first.count, terms, divisor)
                else:
                    new[c] = Local(first.index * m + j, first.count * m, terms, divisor)
    return new


def _expected_terms(mesh_shape, src, dst, c):
    """The contributions rank ``c`` must hold: all those that agree with it on the axes that stay
    Partial."""
    partial_axes = [a for a, p in enumerate(src) if isinstance(p, Partial)]
    choices = [[c[a]] if isinstance(dst[a], Partial) else range(mesh_shape[a]) for a in partial_axes]
    return frozenset(itertools.product(*choices))


# -- the main property -------------------------------------------------------


@settings(max_examples=examples(500))
@given(reachable_pair())
def test_plan_steps_are_legal_and_move_the_data_right(case) -> None:
    mesh_shape, src, dst = case
    steps = plan_redistribute(src, dst)
    if not steps:
        assert tuple(src) == tuple(dst)
    else:
        assert steps[-1].after == tuple(dst)

    state = _initial(mesh_shape, src)
    current = tuple(src)
    for step in steps:
        # exactly one axis changes, the way the step's kind says
        changed = [a for a, (b, c) in enumerate(zip(current, step.after)) if b != c]
        assert changed == [step.axis], (step, current)
        assert isinstance(current[step.axis], SOURCE[step.kind]), (step, current)
        assert type(step.after[step.axis]) is TARGET[step.kind], (step, current)
        if TARGET[step.kind] is Shard:
            assert step.after[step.axis] == S
        # gathers run on the innermost sharded axis before, cuts leave it innermost after
        if step.kind == "allgather":
            assert not any(isinstance(p, Shard) for p in current[step.axis + 1 :]), (step, current)
        if step.kind in ("reduce_scatter", "scatter"):
            assert not any(isinstance(p, Shard) for p in step.after[step.axis + 1 :]), (step, current)
        state = _apply(state, mesh_shape, current, step)
        current = step.after

    n = num_shards(mesh_shape, dst)
    divisor = math.prod(m for m, s, d in zip(mesh_shape, src, dst) if s == AVG and d != AVG)
    for c, local in state.items():
        assert (local.index, local.count) == (shard_index(mesh_shape, dst, c), n), c
        assert local.terms == _expected_terms(mesh_shape, src, dst, c), c
        assert local.divisor == divisor, c


@settings(max_examples=examples(200))
@given(st.integers(1, 3).flatmap(lambda k: st.tuples(st.sampled_from(MESHES[k]), st.lists(st.sampled_from(ALL), min_size=k, max_size=k))))
def test_every_shard_is_held_by_the_same_number_of_ranks(case) -> None:
    mesh_shape, placements = case
    n = num_shards(mesh_shape, placements)
    held = [shard_index(mesh_shape, placements, c) for c in _coords(mesh_shape)]
    copies = math.prod(mesh_shape) // n
    assert sorted(held) == sorted(list(range(n)) * copies)


# -- errors ------------------------------------------------------------------


@settings(max_examples=examples(200))
@given(unreachable_pair())
def test_plans_into_a_new_partial_raise(case) -> None:
    src, dst = case
    with pytest.raises(ValueError, match="nothing turns data into Partial"):
        plan_redistribute(src, dst)


def test_plan_rejects_a_different_number_of_axes() -> None:
    with pytest.raises(ValueError, match="one per mesh axis"):
        plan_redistribute([S, R], [S])


@pytest.mark.parametrize(
    "placements,fix",
    [
        ([Shard(1)], "only Shard\\(0\\) is supported"),
        ([R, Shard(1)], "only Shard\\(0\\) is supported"),
        ([Partial("max")], "only Partial\\('sum'\\) and Partial\\('avg'\\) are supported"),
        ([S, S, S], "give exactly one placement per mesh axis"),
        ([], "give exactly one placement per mesh axis"),
        (["shard"], "use Shard\\(0\\), Replicate\\(\\), Partial\\('sum'\\) or Partial\\('avg'\\)"),
    ],
)
def test_check_placements_names_the_fix(placements, fix) -> None:
    with pytest.raises(ValueError, match=fix):
        check_placements(placements, 2 if len(placements) != 1 else 1)


def test_check_placements_names_the_argument_and_accepts_the_supported() -> None:
    with pytest.raises(ValueError, match=r"^dst\[0\]"):
        check_placements([Shard(1)], 1, name="dst")
    assert check_placements([S, R, SUM, AVG], 4) == (S, R, SUM, AVG)


# -- minimal plans for the common moves ----------------------------------------


def _kinds(src, dst):
    return [(s.kind, s.axis) for s in plan_redistribute(src, dst)]


@pytest.mark.parametrize(
    "src,dst,expected",
    [
        ([SUM], [S], [("reduce_scatter", 0)]),
        ([AVG], [S], [("reduce_scatter", 0)]),
        ([S], [R], [("allgather", 0)]),
        ([R], [S], [("scatter", 0)]),
        ([AVG], [R], [("allreduce", 0)]),
        ([SUM, SUM], [R, S], [("reduce_scatter", 1), ("allreduce", 0)]),  # HSDP gradients
        ([AVG, AVG], [R, S], [("reduce_scatter", 1), ("allreduce", 0)]),
        ([S, S], [R, R], [("allgather", 1), ("allgather", 0)]),
        ([R, S], [R, R], [("allgather", 1)]),  # HSDP parameters
        ([SUM, SUM], [S, S], [("reduce_scatter", 0), ("reduce_scatter", 1)]),
        ([S, R], [S, R], []),
    ],
)
def test_common_moves_take_the_fewest_steps(src, dst, expected) -> None:
    assert _kinds(src, dst) == expected
