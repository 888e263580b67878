"""A float8 all-gather weight: the smallest tensor subclass that speaks FSDP2's all-gather protocol.

``Float8RowwiseWeight`` wraps a high-precision weight (the optimizer updates it as usual). Its
``fsdp_pre_all_gather`` quantises this rank's rows to ``float8_e4m3fn`` with one fp32 scale per row
(amax / 448), so the all-gather moves 1 byte per element plus 4 per row instead of 2 (bf16) or 4
(fp32); ``fsdp_post_all_gather`` dequantises the gathered rows into the compute dtype. The
unsharded weight is that dequantised tensor: forward computes with the float8-rounded weight and
its gradient flows straight through to the high-precision weight (as torchao's float8 training
does with a real float8 matmul; this example keeps the matmul in the compute dtype).

Row-wise scales need no communication, so one process quantising the whole matrix gets the same
values: :class:`STEFloat8Linear` is that single-process reference (straight-through estimator),
used by tests/fsdp/test_extensions.py and tools/bench_fp8_gather.py.

:func:`cast_count` counts this thread's pre-all-gather calls: ``fsdp.fully_shard``
casts once per optimizer step (the float8 shard is kept until the weights change), torch FSDP2
on every all-gather.
"""

from __future__ import annotations

import copy
import math
import threading
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree

__all__ = ["Float8RowwiseWeight", "cast_count", "STEFloat8Linear", "float8_weights", "quantize_dequantize", "reference_float8_model"]

FLOAT8 = torch.float8_e4m3fn
FLOAT8_MAX = torch.finfo(FLOAT8).max  # 448


def quantize_rowwise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 data, fp32 scale per row) of a 2-D tensor."""
    w = w.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / FLOAT8_MAX).clamp(min=1e-12)
    return (w / scale).to(FLOAT8), scale


def dequantize(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (data.float() * scale).to(dtype)


def quantize_dequantize(w: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    return dequantize(*quantize_rowwise(w), dtype or w.dtype)


_CASTS = threading.local()  # per thread: test worlds may run their ranks as threads


def cast_count() -> int:
    """fsdp_pre_all_gather calls (one float8 cast of a shard each) made by this thread so far."""
    return getattr(_CASTS, "n", 0)


class Float8RowwiseWeight(torch.Tensor):

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, data.stride(), data.storage_offset(), dtype=data.dtype, device=data.device
        )

    def __init__(self, data: torch.Tensor) -> None:
        self._data = data

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        out = func(*pytree.tree_map_only(cls, lambda t: t._data, args), **pytree.tree_map_only(cls, lambda t: t._data, kwargs or {}))
        return pytree.tree_map_only(torch.Tensor, cls, out)

    def __tensor_flatten__(self):
        return ["_data"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Float8RowwiseWeight(inner["_data"])

    def __repr__(self) -> str:
        return f"Float8RowwiseWeight({self._data})"

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy) -> tuple[tuple[torch.Tensor, ...], Any]:
        """This rank's rows in float8 plus their scales, padded to the padded piece's rows (the
        protocol's rule for unevenly sharded parameters: every rank sends the same shapes)."""
        _CASTS.n = cast_count() + 1
        rows = math.ceil(outer_size[0] / mesh.size())
        data, scale = quantize_rowwise(self._data)
        if data.shape[0] != rows:
            pad = rows - data.shape[0]
            data = torch.cat([data.view(torch.uint8), data.new_zeros((pad, data.shape[1])).view(torch.uint8)]).view(FLOAT8)
            scale = torch.cat([scale, scale.new_ones((pad, 1))])
        return (data, scale), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out: Optional[torch.Tensor] = None):
        data, scale = outputs
        if out is not None:  # refill the unsharded weight in place (its storage was given back)
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
                out.copy_(dequantize(data, scale, param_dtype)[: out.shape[0]])
            return None
        weight = dequantize(data, scale, param_dtype)
        return weight, (weight,)


class STEFloat8Linear(nn.Linear):
    """The single-process reference: forward with the float8-rounded weight, gradient straight
    through to the weight."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        rounded = w + (quantize_dequantize(w.detach(), x.dtype).to(w.dtype) - w).detach()
        return F.linear(x, rounded.to(x.dtype), self.bias)


def float8_weights(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose ``nn.Linear`` weights are :class:`Float8RowwiseWeight` s."""
    model = copy.deepcopy(model)
    for m in model.modules():
        if type(m) is nn.Linear:
            m.weight = nn.Parameter(Float8RowwiseWeight(m.weight.detach().clone()))
    return model


def reference_float8_model(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose ``nn.Linear`` s are :class:`STEFloat8Linear` (same weights)."""
    model = copy.deepcopy(model)
    for m in model.modules():
        if type(m) is nn.Linear:
            m.__class__ = STEFloat8Linear
    return model
