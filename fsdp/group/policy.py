"""What is sharded and in which dtype: the sharding strategy and the mixed-precision policy.

Both are plain values validated when built, so misuse raises before any buffer or collective.
:func:`converted` takes a buffer into the dtype a policy change (or ``module.to(dtype)``) gives it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Callable, Optional, Union

import torch

if TYPE_CHECKING:
    from dbuffer import DBuffer

__all__ = [
    "FLOAT32_OR_WIDER", "MixedPrecisionPolicy", "Strategy", "as_policy", "converted", "parse_strategy", "reduces_in_grad_dtype",
]


class MainDtype(enum.Enum):
    """``MixedPrecisionPolicy.main_params_dtype``'s default: float32 main weights for a trained
    parameter built in bf16, fp16 or fp32, else (wider, or frozen) its own dtype, so nothing is
    stored less precisely than built. Not ``torch.float32``, which does store a float64 model in
    float32. ``MixedPrecisionPolicy`` raises ``ValueError`` for it in another field."""

    FLOAT32_OR_WIDER = "float32, or the parameter's own dtype where that is wider"

    def __repr__(self) -> str:
        return "fsdp.FLOAT32_OR_WIDER"


FLOAT32_OR_WIDER = MainDtype.FLOAT32_OR_WIDER


@dataclass(frozen=True)
class Strategy:
    """Which of the three per-parameter states live sharded (ZeRO stage = how many are):
    ``shard_optim`` the main weights (and so the optimizer state), ``shard_grads`` the main grads
    (reduce-scatter, not all-reduce), ``shard_params`` the model weights (gathered around forward
    and backward). ``name``: Megatron-FSDP's; ``fully_shard`` takes a Strategy or one of the names
    ``"no_shard"``, ``"optim"``, ``"optim_grads"``, ``"optim_grads_params"``, and raises
    ``ValueError`` for another."""

    name: str
    shard_optim: bool
    shard_grads: bool
    shard_params: bool


STRATEGIES = {
    "no_shard": Strategy("no_shard", False, False, False),
    "optim": Strategy("optim", True, False, False),
    "optim_grads": Strategy("optim_grads", True, True, False),
    "optim_grads_params": Strategy("optim_grads_params", True, True, True),
}


def parse_strategy(value: "str | Strategy") -> Strategy:
    if isinstance(value, Strategy):
        return value
    if not isinstance(value, str) or value not in STRATEGIES:
        raise ValueError(
            f"unknown sharding_strategy {value!r}; use one of {sorted(STRATEGIES)} "
            f"(ZeRO-0..3: no_shard, optim, optim_grads, optim_grads_params)"
        )
    return STRATEGIES[value]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes of the four copies of a floating parameter (FSDP2's names; Megatron-FSDP adds the main
    copies). With no policy a parameter computes in its built dtype (as FSDP2) and its main weights
    are FP32 or wider (as Megatron-FSDP): a BF16-built model trains with FP32 main weights and BF16
    compute, an FP32 one in FP32 throughout, a float64 one in float64.

    * ``main_params_dtype``: the sharded weights the optimizer updates. Default
      ``fsdp.FLOAT32_OR_WIDER``: float32 for a trained parameter built in bf16, fp16 or fp32, its
      own dtype where that is wider or it is frozen. A dtype: that dtype for every floating
      parameter. ``None``: each parameter's own (BF16-built: BF16 main weights, as FSDP2).
    * ``param_dtype``: the compute weights; ``None``: the built dtype (where that is also the main
      dtype, the model weights *are* the main weights, no copy).
    * ``main_grads_dtype``: the gradient accumulation buffer; ``None``: the main dtype, else
      ``param.grad`` is a cast copy of ``param.main_grad``.
    * ``reduce_dtype``: the dtype gradients are averaged in; ``None``: as the installed torch's
      FSDP2 (from 2.15 each gradient's own dtype, before it the compute dtype:
      :func:`reduces_in_grad_dtype`).
    * ``persistent_param_shard``, where a gather cannot cast the main shard into its own row of the
      gathered buffer (host offload, ``Owned`` buckets): True (default) keeps this rank's
      ``param_dtype`` shard between steps (not from a unit's forward to its backward: the
      activations' peak); False casts it into a temporary before each gather, saving that shard's
      memory for one more cast per gather. HFSDP always keeps its shard-axis copy.
    * ``output_dtype`` / ``cast_forward_inputs``: cast the unit's floating outputs / inputs (to
      ``param_dtype``), as FSDP2.
    * ``param_dtype_override_fn`` (keyword only, torch 2.15's): per parameter at ``fully_shard``,
      ``None`` or ``param_dtype`` keeps ``param_dtype`` and the parameter's own dtype computes it in
      that (e.g. a norm in FP32), in a group of its own.

    Raises ``TypeError`` for a non-bool ``persistent_param_shard`` or a non-callable override,
    ``ValueError`` for a dtype that is not floating or None, and (:meth:`for_param`) for an override
    returning another dtype. Non-floating parameters are never cast.
    """

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    output_dtype: Optional[torch.dtype] = None
    cast_forward_inputs: bool = True
    main_params_dtype: Union[torch.dtype, MainDtype, None] = FLOAT32_OR_WIDER
    main_grads_dtype: Optional[torch.dtype] = None
    persistent_param_shard: bool = True
    param_dtype_override_fn: Optional[Callable[[torch.nn.Parameter], Optional[torch.dtype]]] = field(
        default=None, kw_only=True
    )

    def __post_init__(self) -> None:
        fn = self.param_dtype_override_fn
        if fn is not None and not callable(fn):
            raise TypeError(
                f"MixedPrecisionPolicy.param_dtype_override_fn must be a callable (nn.Parameter) -> torch.dtype | None, "
                f"got {fn!r}"
            )
        if not isinstance(self.persistent_param_shard, bool):
            raise TypeError(
                f"MixedPrecisionPolicy.persistent_param_shard must be a bool (True: keep the param_dtype shard, "
                f"False: cast before each gather), got {self.persistent_param_shard!r}"
            )
        for name in ("param_dtype", "reduce_dtype", "output_dtype", "main_params_dtype", "main_grads_dtype"):
            value = getattr(self, name)
            if name == "main_params_dtype" and value is FLOAT32_OR_WIDER:
                continue
            if value is not None and (not isinstance(value, torch.dtype) or not value.is_floating_point):
                raise ValueError(f"MixedPrecisionPolicy.{name} must be a floating torch.dtype or None, got {value!r}")

    def for_param(self, param: torch.Tensor, name: str = "") -> "MixedPrecisionPolicy":
        """This policy for one parameter with ``param_dtype_override_fn`` applied (and removed), as
        FSDP2 does; raises ``ValueError`` naming ``name`` for an invalid override."""
        fn = self.param_dtype_override_fn
        if fn is None:
            return self
        dtype = fn(param)
        if dtype is not None and (not isinstance(dtype, torch.dtype) or dtype not in (self.param_dtype, param.dtype)):
            raise ValueError(
                f"param_dtype_override_fn must return None, param_dtype ({self.param_dtype}) or the parameter's "
                f"original dtype ({param.dtype}) but got {dtype!r} for parameter {name!r}"
            )
        return replace(self, param_dtype=self.param_dtype if dtype is None else dtype, param_dtype_override_fn=None)

    def dtypes_for(
        self, orig: torch.dtype, grad_dtype: Optional[torch.dtype] = None, requires_grad: bool = True
    ) -> "Dtypes":
        """The dtypes of a parameter built as ``orig``, with ``grad_dtype`` for
        ``reduce_dtype=None``; a frozen one (``requires_grad=False``) keeps its own under
        ``FLOAT32_OR_WIDER``."""
        if not orig.is_floating_point:
            return Dtypes(orig, orig, orig, orig)
        main = self.main_params_dtype
        if main is FLOAT32_OR_WIDER:
            main = orig if not requires_grad or orig.itemsize > 4 else torch.float32
        elif main is None:
            main = orig
        model = self.param_dtype or orig
        reduce = self.reduce_dtype
        if reduce is None:
            reduce = torch.promote_types(model, grad_dtype or orig) if reduces_in_grad_dtype() else model
        return Dtypes(main, model, self.main_grads_dtype or main, reduce)


def as_policy(value: object, argument: str = "mp_policy") -> MixedPrecisionPolicy:
    """``value`` as an fsdp policy, torch FSDP2's converted field by field (main weights at their
    default); raises ``TypeError`` naming ``argument`` for anything else."""
    if isinstance(value, MixedPrecisionPolicy):
        return value
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy

    if not isinstance(value, TorchPolicy):
        raise TypeError(
            f"{argument} must be an fsdp.MixedPrecisionPolicy or torch's "
            f"torch.distributed.fsdp.MixedPrecisionPolicy, got {type(value).__name__}"
        )
    ours = {f.name for f in fields(MixedPrecisionPolicy)}
    theirs = {f.name: getattr(value, f.name) for f in fields(value)}
    unknown = sorted(set(theirs) - ours)
    if unknown:
        raise TypeError(
            f"{argument}: torch's MixedPrecisionPolicy field(s) {unknown} have no fsdp equivalent; "
            f"pass an fsdp.MixedPrecisionPolicy instead"
        )
    return MixedPrecisionPolicy(**theirs)


@dataclass(frozen=True)
class Dtypes:
    main: torch.dtype
    model: torch.dtype
    main_grad: torch.dtype
    reduce: torch.dtype


def reduces_in_grad_dtype(fsdp2_param: Optional[type] = None) -> bool:
    """Whether the installed FSDP2 reduces ``reduce_dtype=None`` gradients in each parameter's grad
    dtype (torch 2.15), not the compute dtype; ``fsdp2_param``: the class to inspect."""
    if fsdp2_param is None:
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam as fsdp2_param
    return hasattr(fsdp2_param, "unsharded_grad_dtype")


def converted(buf: DBuffer, dtype: torch.dtype) -> DBuffer:
    """``buf`` if in ``dtype``, else a sibling in it holding its values cast (if it has storage)."""
    if buf.dtype == dtype:
        return buf
    out = buf.sibling(dtype=dtype, zero_fill=False)
    if not buf.is_storage_released():
        out.local_buffer.copy_(buf.local_buffer)
    return out
