"""Megatron-FSDP's ``MixedPrecisionPolicy`` and how it maps onto :class:`fsdp.MixedPrecisionPolicy`.

Megatron-FSDP names three dtypes, with its own defaults:

* ``main_params_dtype`` (default ``torch.float32``): the main weights the optimizer updates;
  ``None``: the parameter's own dtype (the compute weights are the main weights);
* ``main_grads_dtype`` (default ``None``): the gradient accumulation buffer; ``None``: the
  parameter's own dtype (a BF16 model accumulates BF16 main grads), where fsdp's ``None`` means
  the main dtype;
* ``grad_comm_dtype`` (default ``None``): the dtype gradients are reduced in; ``None``: the main
  grads' dtype, where fsdp's ``None`` means FSDP2's (the compute dtype).

Parameters compute in the dtype they were built in (no ``param_dtype``). Since two of the
defaults depend on a parameter's dtype, :meth:`MixedPrecisionPolicy.for_dtype` gives the fsdp
policy of one dtype; ``fully_shard`` uses it per dtype group. Pure values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

import fsdp

__all__ = ["MixedPrecisionPolicy", "as_policy"]

_FIELDS = ("main_params_dtype", "main_grads_dtype", "grad_comm_dtype")


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Megatron-FSDP's precision policy: ``main_params_dtype`` (default ``torch.float32``; None:
    the parameter's own dtype), ``main_grads_dtype`` (default None: the parameter's own dtype)
    and ``grad_comm_dtype`` (default None: the main grads' dtype); parameters compute in the dtype
    they were built in. See the module docstring for how each maps onto fsdp's policy.
    ``ValueError`` for a field that is neither a floating ``torch.dtype`` nor None."""

    main_params_dtype: Optional[torch.dtype] = torch.float32
    main_grads_dtype: Optional[torch.dtype] = None
    grad_comm_dtype: Optional[torch.dtype] = None

    def __post_init__(self) -> None:
        for name in _FIELDS:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, torch.dtype) or not value.is_floating_point):
                raise ValueError(f"MixedPrecisionPolicy.{name} must be a floating torch.dtype or None, got {value!r}")

    def for_dtype(self, dtype: torch.dtype) -> fsdp.MixedPrecisionPolicy:
        """The fsdp policy of parameters built in ``dtype``: Megatron-FSDP's dtypes for them."""
        main_grads = self.main_grads_dtype or dtype
        return fsdp.MixedPrecisionPolicy(
            main_params_dtype=self.main_params_dtype,
            main_grads_dtype=main_grads,
            reduce_dtype=self.grad_comm_dtype or main_grads,
        )


def as_policy(value: Any) -> MixedPrecisionPolicy:
    """``value`` as fsdp.megatron's policy: None gives the defaults; this class as it is; any
    object with the three fields (megatron-fsdp's own ``MixedPrecisionPolicy``) field by field.
    ``TypeError`` for anything else, naming the argument."""
    if value is None:
        return MixedPrecisionPolicy()
    if isinstance(value, MixedPrecisionPolicy):
        return value
    if all(hasattr(value, name) for name in _FIELDS):
        return MixedPrecisionPolicy(**{name: getattr(value, name) for name in _FIELDS})
    raise TypeError(
        f"mixed_precision_policy must be an fsdp.megatron.MixedPrecisionPolicy (main_params_dtype, "
        f"main_grads_dtype, grad_comm_dtype) or None, got {type(value).__name__}"
    )
