"""RowShardedDTensor: every DTensor op gives the single-process answer, or a clear error.

Property-tested over tensor shapes (so row-atomic splits differ from ``torch.chunk``'s in many
ways: empty pieces, one rank holding everything), world sizes and meshes. The reference is the
op on the full tensors in one process; a DTensor result is compared through ``full_tensor()``.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from dbuffer import RowShardedDTensor, distribute_tensors
from tests.harness import run_ranks
from tests.hypothesis_profiles import examples

S, R = Shard(0), Replicate()


def _full(x):
    return x.full_tensor() if isinstance(x, DTensor) else x


# Each case: (name, op on a DTensor p (with q, another tensor laid out like p, and the same
# full values as a plain torch.chunk DTensor d), op on the full tensors, exact?)
def _cases(p, q, d, g_seed: int):
    full_p, full_q = p.full_tensor(), q.full_tensor()
    gen = torch.Generator().manual_seed(g_seed)
    ref_gen = torch.Generator().manual_seed(g_seed)
    return [
        ("p * 2", lambda: p * 2, lambda: full_p * 2, True),
        ("p + 1.5", lambda: p + 1.5, lambda: full_p + 1.5, True),
        ("lerp(p, q)", lambda: torch.lerp(p, q, 0.3), lambda: torch.lerp(full_p, full_q, 0.3), True),
        ("zeros_like", lambda: torch.zeros_like(p), lambda: torch.zeros_like(full_p), True),
        ("full_like", lambda: torch.full_like(p, 7.0), lambda: torch.full_like(full_p, 7.0), True),
        ("detach().clone()", lambda: p.detach().clone(), lambda: full_p.clone(), True),
        ("to(float64)", lambda: p.to(torch.float64), lambda: full_p.to(torch.float64), True),
        ("in-place mul_", lambda: p.clone().mul_(3), lambda: full_p * 3, True),
        ("foreach add", lambda: torch._foreach_add([p, q], [q, p])[0], lambda: full_p + full_q, True),
        ("minus chunk DTensor", lambda: p - d, lambda: full_p - full_p, True),
        ("copy_ from chunk DTensor", lambda: q.clone().copy_(d), lambda: full_p, True),
        ("copy_ into chunk DTensor", lambda: d.clone().copy_(q), lambda: full_q, True),
        ("copy_ from float64 chunk DTensor", lambda: q.clone().copy_(d.to(torch.float64)), lambda: full_p, True),
        ("copy_ broadcasts a row", lambda: q.clone().copy_(d[:1]), lambda: full_p[:1].expand_as(full_q), True),
        ("sum", lambda: p.sum(), lambda: full_p.sum(), False),
        ("norm", lambda: p.norm(), lambda: full_p.norm(), False),
        ("mean", lambda: p.mean(), lambda: full_p.mean(), False),
        ("amax", lambda: p.amax(), lambda: full_p.amax(), True),
        ("sum(-1)", lambda: p.sum(-1), lambda: full_p.sum(-1), False),
        ("foreach_norm", lambda: torch._foreach_norm([p, q])[1], lambda: full_q.norm(), False),
        ("redistribute R", lambda: p.redistribute(p.device_mesh, [R] * p.device_mesh.ndim), lambda: full_p, True),
        ("redistribute S", lambda: p.redistribute(p.device_mesh, [S] * p.device_mesh.ndim), lambda: full_p, True),
        ("uniform_(generator)", lambda: p.clone().uniform_(generator=gen), lambda: full_p.clone().uniform_(generator=ref_gen), True),
        ("matmul", lambda: p.reshape(p.shape) @ q.t(), lambda: full_p @ full_q.t(), False),
        ("view(-1)", lambda: p.view(-1), lambda: full_p.view(-1), True),
        ("[..., :1]", lambda: p[..., :1], lambda: full_p[..., :1], True),
    ]


def _check_ops(shapes, mesh_shape, placements, seed: int) -> tuple[int, int]:
    """Checks every case on each row-sharded view; returns (cases checked, views checked)."""
    mesh = init_device_mesh("cpu", mesh_shape)
    gen = torch.Generator().manual_seed(seed)
    fulls_p = [torch.randn(s, generator=gen) for s in shapes]
    fulls_q = [torch.randn(s, generator=gen) for s in shapes]
    bp = distribute_tensors(fulls_p, mesh, placements)
    bq = distribute_tensors(fulls_q, mesh, placements)
    checked = ragged = 0
    for i, shape in enumerate(shapes):
        p, q = bp.get_dtensor(i), bq.get_dtensor(i)
        if not isinstance(p, RowShardedDTensor):
            continue  # rows as torch.chunk's: a plain DTensor, whose behaviour is torch's
        ragged += 1
        d = distribute_tensor(fulls_p[i], mesh, [S if pl == S else R for pl in placements])
        for name, op, ref_op, exact in _cases(p, q, d, seed):
            if len(shape) < 2 and name in ("matmul", "sum(-1)"):
                continue
            try:
                expected = ref_op()
            except RuntimeError:
                continue  # not an op of this shape in one process either
            try:
                got = op()
            except NotImplementedError as exc:  # a clear refusal is allowed, never a wrong value
                assert "full_tensor()" in str(exc), (name, str(exc))
                continue

            tol = {} if not exact else {"rtol": 0, "atol": 0}
            torch.testing.assert_close(_full(got), expected, **tol, msg=lambda m: f"{name} {shape}: {m}")
            checked += 1
        # the operands are untouched by out-of-place ops
        torch.testing.assert_close(p.full_tensor(), fulls_p[i], rtol=0, atol=0)
    return checked, ragged


# At least two tensors: one alone has torch.chunk's rows (a plain DTensor, which _check_ops skips).
shapes_st = st.lists(
    st.tuples(st.integers(1, 7), st.integers(1, 5)).map(lambda t: t if t[1] > 1 else (t[0],)),
    min_size=2,
    max_size=4,
)
meshes = st.sampled_from([((2,), [S]), ((3,), [S]), ((4,), [S]), ((2, 2), [S, S]), ((2, 2), [R, S])])


@pytest.mark.hypothesis
def test_every_op_is_exact_or_refused() -> None:
    """The property, then its guard against testing nothing: most of the examples it ran held
    row-sharded tensors (counted in this test, so it holds whatever ran before)."""
    ragged: list[int] = []  # per example: how many of its tensors were row-sharded

    @settings(max_examples=examples(12))
    @given(shapes=shapes_st, mesh=meshes, seed=st.integers(0, 2**16))
    def every_op_is_exact_or_refused(shapes, mesh, seed) -> None:
        mesh_shape, placements = mesh
        results = run_ranks(_check_ops, math.prod(mesh_shape), shapes, mesh_shape, placements, seed, backend="threaded")
        assert all(checked >= views for checked, views in results)
        ragged.append(results[0][1])

    every_op_is_exact_or_refused()
    assert sum(1 for r in ragged if r) >= len(ragged) // 2 > 0, ragged


def test_row_sharded_views_really_occur_and_work_on_gloo() -> None:
    # shapes whose packed rows differ from torch.chunk's on 2 ranks
    results = run_ranks(_check_ops, 2, [(3, 4), (1, 5), (5,)], (2,), [S], 3, backend="gloo")
    assert all(ragged > 0 for _, ragged in results)


def _in_place_writes_keep_rows() -> bool:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = torch.arange(15.0).view(5, 3)
    buf = distribute_tensors([torch.zeros(1, 3), full], mesh, [S])
    p = buf.get_dtensor(1)
    assert isinstance(p, RowShardedDTensor)
    p.mul_(2)  # local path: the buffer itself changes
    p.add_(distribute_tensor(full, mesh, [S]))  # different rows: the full path, written back
    torch.testing.assert_close(p.full_tensor(), 3 * full, rtol=0, atol=0)
    torch.testing.assert_close(buf.get_dtensor(1).full_tensor(), 3 * full, rtol=0, atol=0)
    copied = copy.deepcopy(p)  # through __tensor_flatten__ / __tensor_unflatten__
    assert isinstance(copied, RowShardedDTensor) and copied._local_tensor.data_ptr() != p._local_tensor.data_ptr()
    torch.testing.assert_close(copied.full_tensor(), 3 * full, rtol=0, atol=0)
    try:
        p.mm(p.t())
    except NotImplementedError as exc:  # p.t() would move rows between ranks
        assert "full_tensor()" in str(exc)
    else:
        raise AssertionError("p.t() of a row-sharded DTensor must be refused")
    return True


def test_in_place_ops_write_the_buffer() -> None:
    assert all(run_ranks(_in_place_writes_keep_rows, 2, backend="threaded"))
