"""What is sharded and in which dtype: the sharding strategy and the mixed-precision policy.

Both are plain values, validated when built, so every misuse raises before any buffer exists or
any collective runs. :func:`converted` takes a group's buffer into the dtype a policy change (or
``module.to(dtype)``) gives it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Callable, Optional, Union

import torch

if TYPE_CHECKING:  # annotations only
    from dbuffer import DBuffer

__all__ = [
    "FLOAT32_OR_WIDER",
    "MixedPrecisionPolicy",
    "Strategy",
    "as_policy",
    "converted",
    "parse_strategy",
    "reduces_in_grad_dtype",
]


class MainDtype(enum.Enum):
    """``MixedPrecisionPolicy.main_params_dtype``'s default, ``fsdp.FLOAT32_OR_WIDER``: main
    weights in float32 for a trained parameter built in bf16, fp16 or fp32, in the parameter's
    own dtype where that is wider (float64 stays float64) or where it is frozen, so that no parameter is stored less precisely
    than it was built unless a policy says so. A value of its own, not ``torch.float32``: an
    explicit ``torch.float32`` does store a float64 model in float32. It is valid only as that
    field's value; ``MixedPrecisionPolicy`` raises ``ValueError`` for it in another field."""

    FLOAT32_OR_WIDER = "float32, or the parameter's own dtype where that is wider"

    def __repr__(self) -> str:
        return "fsdp.FLOAT32_OR_WIDER"


FLOAT32_OR_WIDER = MainDtype.FLOAT32_OR_WIDER


@dataclass(frozen=True)
class Strategy:
    """Which of the three per-parameter states live sharded (ZeRO stage = how many are).

    ``name``: Megatron-FSDP's name of the strategy. ``shard_optim``: the main weights, and so the
    optimizer state made like them, are sharded. ``shard_grads``: the main grads are sharded
    (reduce-scatter instead of all-reduce). ``shard_params``: the model weights are gathered
    before forward and backward and freed after. ``fully_shard(sharding_strategy=)`` takes one of
    the four named values (``"no_shard"``, ``"optim"``, ``"optim_grads"``,
    ``"optim_grads_params"``) or a Strategy; another name raises ``ValueError`` listing them.
    """

    name: str
    shard_optim: bool  # main weights (and so optimizer state)
    shard_grads: bool  # main grads: reduce-scatter instead of all-reduce
    shard_params: bool  # model weights: gathered before forward and backward, freed after


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
    """Dtypes of the four copies of a floating parameter.

    FSDP2 names are kept (``param_dtype``, ``reduce_dtype``, ``output_dtype``,
    ``cast_forward_inputs``); Megatron-FSDP adds the main copies. With no policy at all a
    parameter computes in the dtype it was built in (as FSDP2) and its main weights are FP32 or
    wider (as Megatron-FSDP): a BF16-built model trains with FP32 main weights and BF16 compute,
    an FP32 one in FP32 throughout, a float64 one in float64.

    * ``main_params_dtype``: the sharded weights the optimizer updates. Default
      ``fsdp.FLOAT32_OR_WIDER``: float32 for a trained parameter built in bf16, fp16 or fp32 (or
      float8), its own dtype where that is wider (float64 stays float64) and for a frozen one
      (``requires_grad=False``: no optimizer step to keep precise). A dtype: that dtype for every floating
      parameter (``torch.bfloat16`` for BF16 main weights). ``None``: each parameter's own
      dtype (then a BF16-built model keeps BF16 main weights, as FSDP2).
    * ``param_dtype``: the model/compute weights forward and backward run with. ``None``: the
      dtype the parameter was built in (then, where that is also the main dtype, the model
      weights *are* the main weights, no copy).
    * ``main_grads_dtype``: the gradient accumulation buffer. ``None``: the main dtype. When it
      differs from the main dtype, ``param.grad`` is a cast copy of ``param.main_grad``.
    * ``reduce_dtype``: the dtype gradients are averaged across ranks in. ``None``: as the
      installed torch's FSDP2 does: from torch 2.15 each parameter's own gradient dtype (its
      ``grad_dtype`` if set, else its original dtype; promoted with the compute dtype), before
      2.15 the compute dtype (:func:`reduces_in_grad_dtype`).

    And one memory/speed knob, for when ``param_dtype`` differs from the main dtype:

    * ``persistent_param_shard``: where a gather can, it casts the main shard straight into its
      own row of the gathered buffer and gathers in place (FSDP2's copy-in; every packed layout
      on the compute device), and no ``param_dtype`` shard exists whatever this says. Where it
      cannot (host offload, ``Owned`` buckets), True (default) keeps this rank's shard of the
      model weights in ``param_dtype`` between steps (written by the optimizer step, or cast
      once after it), so the forward's all-gather reads it as is; it is not kept from a unit's
      forward to its backward, the span of the activations' peak: a unit resharded after a
      forward with grad casts it again for its backward gather, and a unit whose gathered
      weights stay until the next step (the root from forward to the end of backward;
      ``optim``/``optim_grads`` after their gather) drops it once gathered. False (lean) casts
      the shard into a temporary right before each gather, freed when the gather lands, saving
      ``shard numel x param_dtype size`` per rank between steps for one more cast per gather.
      HFSDP always keeps its shard-axis copy.

    ``output_dtype`` casts the unit's floating outputs; ``cast_forward_inputs`` casts its floating
    inputs to ``param_dtype`` (both as FSDP2). ``param_dtype_override_fn`` (torch 2.15's,
    keyword only): called once per parameter at ``fully_shard``; ``None`` or ``param_dtype``
    keeps ``param_dtype`` for it, the parameter's own dtype computes it in that dtype (e.g. a
    norm kept in FP32 under a BF16 policy); parameters of different compute dtypes go to
    different groups. Construction raises ``TypeError`` for a non-bool
    ``persistent_param_shard`` or a non-callable override, ``ValueError`` for a dtype that is not
    a floating ``torch.dtype`` (or None); :meth:`for_param` raises ``ValueError`` for an override
    that returns another dtype. Non-floating parameters are never cast.
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
        """This policy for one parameter: ``param_dtype_override_fn`` applied (and removed), as
        FSDP2 resolves it at ``fully_shard``. Raises ``ValueError`` naming the parameter for an
        override other than None, ``param_dtype`` or the parameter's own dtype."""
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
        """The dtypes of a parameter built as ``orig`` (non-floating ones are never cast);
        ``grad_dtype``: its ``grad_dtype`` where set (torch 2.15), for ``reduce_dtype=None``;
        ``requires_grad``: whether the optimizer trains it (``FLOAT32_OR_WIDER`` keeps a frozen
        parameter in its own dtype: no step needs the precision, and a frozen float8 or BF16
        base model would otherwise be stored in FP32)."""
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
    """``value`` as an fsdp policy: fsdp's as it is; torch FSDP2's ``MixedPrecisionPolicy`` (any
    torch 2.11-2.15) converted field by field, Megatron's main weights at their default. Anything
    else raises ``TypeError`` naming ``argument``."""
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
    """Whether the installed torch's FSDP2 reduces ``reduce_dtype=None`` gradients in each
    parameter's gradient dtype (torch 2.15: ``FSDPParam.unsharded_grad_dtype``) rather than in
    the compute dtype (earlier). ``fsdp2_param``: the class to inspect (default torch's), so a
    test drives both answers."""
    if fsdp2_param is None:
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam as fsdp2_param
    return hasattr(fsdp2_param, "unsharded_grad_dtype")


def converted(buf: DBuffer, dtype: torch.dtype) -> DBuffer:
    """``buf`` itself if already in ``dtype``, else rebuilt in it (same mesh, placements, layout,
    device) with its values cast, if it has storage (the new one always has)."""
    if buf.dtype == dtype:
        return buf
    out = buf.sibling(dtype=dtype, zero_fill=False)
    if not buf.is_storage_released():
        out.local_buffer.copy_(buf.local_buffer)
    return out
