"""What :class:`fsdp.optim.flat.FlatOptimizer` runs per chunk: torch's functional kernels."""

from __future__ import annotations

import torch
from torch.optim.adam import adam as _adam
from torch.optim.optimizer import _get_scalar_dtype
from torch.optim.sgd import sgd as _sgd


class Workspace:
    """One chunk-sized buffer per upcast tensor for one step, allocated by its first upcast."""

    def __init__(self, numel: int) -> None:
        self.numel = numel
        self.buffers: dict[str, torch.Tensor] = {}

    def upcast(self, key: str, chunk: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        buffer = self.buffers.get(key)
        if buffer is None or buffer.dtype != dtype or buffer.device != chunk.device:
            buffer = self.buffers[key] = torch.empty(self.numel, dtype=dtype, device=chunk.device)
        out = buffer[: chunk.numel()]
        out.copy_(chunk)
        return out


def fused_by_default(device: torch.device) -> bool:
    """Whether a flat step on ``device`` left to torch.optim's choice is fused: on CUDA, where it is
    bandwidth-bound; elsewhere torch.optim's default, equal bit for bit. A test drives it."""
    return device.type == "cuda"


class _AdamKernel:
    """torch.optim.Adam / AdamW (``decoupled_weight_decay``) through ``torch.optim.adam.adam``."""

    fusable = True  # FlatOptimizer may choose the fused kernel (fused_by_default)

    @staticmethod
    def state_names(opts: dict) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if opts["amsgrad"] else ("exp_avg", "exp_avg_sq")

    @staticmethod
    def step(weights, grad, states: dict, count: int, opts: dict) -> None:
        on_device = opts["capturable"] or opts["fused"]
        step = torch.tensor(
            float(count),
            dtype=_get_scalar_dtype(is_fused=opts["fused"]) if on_device else _get_scalar_dtype(),
            device=weights.device if on_device else "cpu",
        )
        beta1, beta2 = opts["betas"]
        _adam(
            [weights],
            [grad],
            [states["exp_avg"]],
            [states["exp_avg_sq"]],
            [states["max_exp_avg_sq"]] if opts["amsgrad"] else [],
            [step],
            foreach=opts["foreach"],
            capturable=opts["capturable"],
            differentiable=False,
            fused=opts["fused"],
            has_complex=False,
            decoupled_weight_decay=opts.get("decoupled_weight_decay", False),
            amsgrad=opts["amsgrad"],
            beta1=beta1,
            beta2=beta2,
            lr=opts["lr"],
            weight_decay=opts["weight_decay"],
            eps=opts["eps"],
            maximize=opts["maximize"],
        )


class _SGDKernel:
    """torch.optim.SGD; a parameter's first step passes None, then copies the buffer torch made."""

    fusable = False  # torch.optim's own choice stands

    @staticmethod
    def state_names(opts: dict) -> tuple[str, ...]:
        return ("momentum_buffer",) if opts["momentum"] != 0 else ()

    @staticmethod
    def step(weights, grad, states: dict, count: int, opts: dict) -> None:
        buffers = [states["momentum_buffer"] if count > 0 else None] if "momentum_buffer" in states else []
        _sgd(
            [weights],
            [grad],
            buffers,
            weight_decay=opts["weight_decay"],
            momentum=opts["momentum"],
            lr=opts["lr"],
            dampening=opts["dampening"],
            nesterov=opts["nesterov"],
            maximize=opts["maximize"],
            has_sparse_grad=False,
            foreach=opts["foreach"],
            fused=opts["fused"],
        )
        if buffers and count == 0:
            states["momentum_buffer"].copy_(buffers[0])


KERNELS = {torch.optim.AdamW: _AdamKernel, torch.optim.Adam: _AdamKernel, torch.optim.SGD: _SGDKernel}
