"""fsdp.unit.casting: a unit's forward inputs in the policy's param_dtype, walking no tree when
the inputs are flat and already there."""

import torch

from fsdp.unit.casting import cast_inputs

BF16 = torch.bfloat16


def test_flat_inputs_in_the_dtype_come_back_as_the_same_objects() -> None:
    h, ids = torch.ones(2, 3, dtype=BF16), torch.arange(3)
    args, kwargs = (h, ids, 0.5, None), {"mask": torch.ones(3, dtype=torch.bool), "scale": 2}
    out_args, out_kwargs = cast_inputs(args, kwargs, BF16)
    assert out_args is args and out_kwargs is kwargs


def test_floating_tensors_in_another_dtype_are_cast_flat_or_nested() -> None:
    h, ids = torch.randn(2, 3), torch.arange(3)
    args, kwargs = (h, ids), {"rope": (torch.randn(3), [torch.randn(3, dtype=torch.float64)]), "n": 1}
    (a_h, a_ids), kw = cast_inputs(args, kwargs, BF16)
    assert a_h.dtype == BF16 and torch.equal(a_h, h.to(BF16))
    assert a_ids is ids  # integer tensors keep their dtype
    cos, (sin,) = kw["rope"]
    assert cos.dtype == sin.dtype == BF16 and kw["n"] == 1
    assert h.dtype == torch.float32  # the caller's tensors are not changed


def test_a_container_in_the_dtype_is_walked_and_kept() -> None:
    t = torch.ones(3, dtype=BF16)
    (pair,), kwargs = cast_inputs(((t, t),), {}, BF16)
    assert pair[0] is t and pair[1] is t and kwargs == {}


def test_flat_inputs_are_cast_one_by_one() -> None:
    h, cos, ids = torch.randn(2, 3), torch.randn(3, dtype=torch.float64), torch.arange(3)
    (a_h, a_cos, a_ids, scale), kw = cast_inputs((h, cos, ids, 0.5), {"sin": cos}, BF16)
    assert a_h.dtype == a_cos.dtype == kw["sin"].dtype == BF16 and a_ids is ids and scale == 0.5
    assert torch.equal(a_cos, cos.to(BF16))
