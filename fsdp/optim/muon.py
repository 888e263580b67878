"""Muon for 2-D weights, AdamW for the rest, on whole tensors or on dbuffer ``Owned()`` pieces.

Muon (Jordan et al., 2024) steps along the approximate orthogonalisation of each weight matrix's
momentum, which needs the *whole* matrix: no rank has it under ``Shard(0)``. Under dbuffer's
``Owned()`` each matrix lives whole on its owner, which steps it alone; the others hold 0 rows and
skip it, and the traffic is ZeRO-3's. :class:`Muon` touches ``_local_tensor`` only, so it never
communicates; its state is laid out like each parameter, so it checkpoints with DCP like them, and
an Owned run equals a single-device run bit for bit (tests/fsdp/test_muon.py).

Updates, for ``W`` of shape ``(rows, cols)`` with gradient ``G``:

* Muon: ``B <- lerp(B, G, 1 - momentum)``, ``U = lerp(G, B, momentum)`` if ``nesterov`` else ``B``,
  ``W <- W * (1 - lr * weight_decay) - lr * scale * NS(U)`` (:func:`newton_schulz`), ``scale =
  sqrt(max(1, rows / cols))`` (``adjust_lr="original"``) or ``0.2 * sqrt(max(rows, cols))``
  (``"match_rms_adamw"``, Moonshot's: AdamW's lr and weight decay carry over).
* AdamW for the rest, ``adamw_lr`` scaled by ``lr / base_lr`` (the group's lr when added) so an lr
  scheduler moves both parts: ``m <- lerp(m, G, 1 - beta1)``, ``v <- beta2 v + (1 - beta2) G^2``,
  ``W <- W * (1 - adamw_lr * adamw_weight_decay) - adamw_lr / (1 - beta1^t) * m / (sqrt(v) /
  sqrt(1 - beta2^t) + adamw_eps)``.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch
from torch.distributed.tensor import DTensor, Partial

__all__ = ["NS_COEFFICIENTS", "Muon", "newton_schulz"]

# (a, b, c) of the quintic X <- a X + b (X X^T) X + c (X X^T)^2 X of public Muon implementations:
# a large slope at 0 grows small singular values fast, at the price of ending near 1, not at it.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)

_ADJUST_LR = ("original", "match_rms_adamw")
_NS_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def newton_schulz(
    m: torch.Tensor,
    steps: int = 5,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The approximate orthogonalisation of the matrix ``m``, as a new ``dtype`` tensor: ``m`` over
    its norm (at least ``eps``), then ``steps`` quintic iterations ``s -> a s + b s^3 + c s^5`` of
    each singular value; tall matrices are transposed."""
    if m.dim() != 2:
        raise ValueError(f"newton_schulz needs a 2-D matrix, got shape {tuple(m.shape)}")
    a, b, c = coefficients
    tall = m.shape[0] > m.shape[1]
    x = m.to(dtype, copy=True)
    if tall:
        x = x.mT
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b * gram + c * gram @ gram
        x = torch.addmm(x, poly, x, beta=a)  # a * x + poly @ x
    return x.mT if tall else x


class Muon(torch.optim.Optimizer):
    """Muon for 2-D parameters, AdamW for the others (the math: module docstring).

    Args:
        params: tensors (plain, or DTensors whose local piece is all or none of the tensor) or
            param groups, which may set any option below and ``use_muon``: ``None`` (default) picks
            Muon for 2-D parameters, ``True`` forces Muon (all 2-D), ``False`` AdamW (embeddings).
        lr, momentum, nesterov, ns_steps, weight_decay: Muon's step size, momentum in [0, 1),
            Nesterov look-ahead, Newton–Schulz iterations and decoupled weight decay.
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: the AdamW part's hyperparameters.
        ns_coefficients, ns_eps, ns_dtype: the quintic's (a, b, c), the norm's floor and the
            iteration's dtype (fp32 default; bf16 is faster and less exact).
        adjust_lr: ``"original"`` or ``"match_rms_adamw"`` (the update's scale).

    Raises ``ValueError`` for invalid options and a matrix split across ranks (``Shard(0)``):
    Newton–Schulz of a piece is not a piece of Newton–Schulz.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        weight_decay: float = 0.0,
        adamw_lr: float = 3e-4,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.0,
        *,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        ns_eps: float = 1e-7,
        ns_dtype: torch.dtype = torch.float32,
        adjust_lr: str = "original",
    ) -> None:
        defaults = dict(
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            weight_decay=weight_decay,
            adamw_lr=adamw_lr,
            adamw_betas=adamw_betas,
            adamw_eps=adamw_eps,
            adamw_weight_decay=adamw_weight_decay,
            ns_coefficients=ns_coefficients,
            ns_eps=ns_eps,
            ns_dtype=_dtype_name(ns_dtype),
            adjust_lr=adjust_lr,
            use_muon=None,
        )
        _check_options(defaults, "Muon")
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        where = f"param group {len(self.param_groups) - 1}"
        _check_options(group, where)
        group.setdefault("base_lr", group["lr"])  # the lr that adamw_lr goes with (see _adamw)
        for j, p in enumerate(group["params"]):
            if group["use_muon"] and p.dim() != 2:
                raise ValueError(
                    f"{where} has use_muon=True but params[{j}] has shape {tuple(p.shape)}; Muon "
                    f"steps 2-D matrices only: put it in a group with use_muon=False (AdamW)"
                )

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, group in enumerate(self.param_groups):
            for j, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                local, grad = _local_pieces(p, f"param group {gi}, params[{j}]")
                use_muon = group["use_muon"] if group["use_muon"] is not None else p.dim() == 2
                if use_muon:
                    self._muon(p, local, grad, group, f"param group {gi}, params[{j}]")
                else:
                    self._adamw(p, local, grad, group)
        return loss

    def _muon(self, p: torch.Tensor, local: torch.Tensor, grad: torch.Tensor, group: dict, where: str) -> None:
        rows, cols = p.shape
        state = _state_like(self.state[p], p, ("momentum_buffer",))
        if tuple(local.shape) != (rows, cols):
            if local.shape[0] == 0:
                return  # another rank owns this matrix
            raise ValueError(
                f"{where}: this rank holds {local.shape[0]} of the {rows} rows of a matrix; Muon "
                f"needs whole matrices on one rank: place the parameters with dbuffer's Owned() "
                f"(or replicate them), not Shard(0)"
            )
        if local.numel() == 0:
            return
        buf = _local(state["momentum_buffer"])
        momentum = group["momentum"]
        buf.lerp_(grad, 1 - momentum)
        update = torch.lerp(grad, buf, momentum) if group["nesterov"] else buf
        ns_dtype = _NS_DTYPES[group["ns_dtype"]]
        ortho = newton_schulz(update, group["ns_steps"], group["ns_coefficients"], group["ns_eps"], ns_dtype)
        scale = math.sqrt(max(1.0, rows / cols)) if group["adjust_lr"] == "original" else 0.2 * math.sqrt(max(rows, cols))
        lr = group["lr"]
        if group["weight_decay"]:
            local.mul_(1 - lr * group["weight_decay"])
        local.add_(ortho, alpha=-lr * scale)

    def _adamw(self, p: torch.Tensor, local: torch.Tensor, grad: torch.Tensor, group: dict) -> None:
        state = _state_like(self.state[p], p, ("exp_avg", "exp_avg_sq"))
        state["step"] = state.get("step", 0) + 1
        if local.numel() == 0:
            return  # another rank holds this tensor (or it is empty)
        t = state["step"]
        # follows the group's lr (module docstring); lr=0 is how DCP initialises optimizer state
        base = group["base_lr"]
        lr = group["adamw_lr"] * (group["lr"] / base) if base else group["adamw_lr"]
        beta1, beta2 = group["adamw_betas"]
        exp_avg, exp_avg_sq = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
        if group["adamw_weight_decay"]:
            local.mul_(1 - lr * group["adamw_weight_decay"])
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**t)).add_(group["adamw_eps"])
        local.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1**t))


def _state_like(state: dict, p: torch.Tensor, keys: tuple[str, ...]) -> dict:
    """Zero state ``keys`` laid out like ``p`` on every rank, so DCP checkpoints it like ``p``."""
    for key in keys:
        if key not in state:
            state[key] = torch.zeros_like(p, memory_format=torch.contiguous_format).detach()
    return state


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _local_pieces(p: torch.Tensor, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's pieces of ``p`` and its gradient, which must agree in kind, shape, placements."""
    grad = p.grad
    if not isinstance(p, DTensor):
        if isinstance(grad, DTensor):
            raise TypeError(f"{where}: the parameter is a plain tensor but its grad is a DTensor")
        return p, grad
    if not isinstance(grad, DTensor):
        raise TypeError(
            f"{where}: the parameter is a DTensor but its grad is a {type(grad).__name__}; set "
            f"p.grad to a DTensor laid out like p (e.g. grads.get_dtensor(i) of an Owned buffer)"
        )
    for name, t in (("parameter", p), ("grad", grad)):
        if any(isinstance(pl, Partial) for pl in t.placements):
            raise ValueError(
                f"{where}: the {name} has placements {list(t.placements)}; reduce it first "
                f"(e.g. reduce-scatter gradients to Owned()) before stepping"
            )
    local, glocal = p._local_tensor, grad._local_tensor
    if local.shape != glocal.shape:
        raise ValueError(
            f"{where}: the parameter's local piece has shape {tuple(local.shape)} but its grad's "
            f"has {tuple(glocal.shape)}; lay both out with the same placements and layout"
        )
    return local, glocal


def _dtype_name(dtype: Any) -> Any:
    """Param groups keep the dtype by name: checkpoint writers (DCP) store plain values."""
    return str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else dtype


def _check_options(group: dict[str, Any], where: str) -> None:
    def bad(name: str, rule: str) -> ValueError:
        return ValueError(f"{where}: {name}={group[name]!r} is invalid; {rule}")

    for name in ("lr", "weight_decay", "adamw_lr", "adamw_weight_decay", "adamw_eps", "ns_eps"):
        if not isinstance(group[name], (int, float)) or not group[name] >= 0:
            raise bad(name, "use a number >= 0")
    if not isinstance(group["momentum"], (int, float)) or not 0 <= group["momentum"] < 1:
        raise bad("momentum", "use a number in [0, 1)")
    betas = group["adamw_betas"]
    if len(tuple(betas)) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas):
        raise bad("adamw_betas", "use two numbers in [0, 1)")
    if not isinstance(group["ns_steps"], int) or group["ns_steps"] < 1:
        raise bad("ns_steps", "use an int >= 1 (5 is the usual choice)")
    if len(tuple(group["ns_coefficients"])) != 3:
        raise bad("ns_coefficients", "give the quintic's three coefficients (a, b, c)")
    group["ns_dtype"] = _dtype_name(group["ns_dtype"])
    if group["ns_dtype"] not in _NS_DTYPES:
        raise bad("ns_dtype", "use torch.float32, torch.bfloat16 or torch.float64")
    if group["adjust_lr"] not in _ADJUST_LR:
        raise bad("adjust_lr", f"use one of {_ADJUST_LR}")
    if group["use_muon"] not in (None, True, False):
        raise bad("use_muon", "use None (2-D params get Muon), True or False")
