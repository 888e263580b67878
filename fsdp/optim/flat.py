"""Optimizer steps over the flat shards (Megatron's distributed optimizer), opt-in.

Why: ``torch.optim`` steps the sharded parameters one by one and needs ``param.grad`` in the
parameter's dtype, so with BF16 main grads a full-size FP32 copy of every gradient shard exists at
the step. :class:`FlatOptimizer` steps each group's FP32 main weights as one flat tensor with
torch's functional kernels, ``chunk_numel`` elements at a time, upcasting BF16 grads into one FP32
workspace and writing a kept model shard in the same pass; the state is one flat tensor per name and
group (host-side: :mod:`fsdp.optim.offloaded`). Guide: fsdp/README.md, "Mixed precision and memory".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Union

import torch
import torch.nn as nn

from fsdp.group.param_group import ParameterGroup
from fsdp.group.residence import Chunk
from fsdp.optim.flat_groups import Span, param_specs, reduce_over_mesh, spans
from fsdp.optim.flat_kernels import KERNELS, Workspace, fused_by_default
from fsdp.optim.offloaded import flat_offloaded_step, rehome_flat

__all__ = ["FlatAdam", "FlatAdamW", "FlatOptimizer", "FlatSGD", "flat_optimizer"]


@dataclass(frozen=True)
class _Run:
    """Contiguous parameters with the same step count: one kernel call per chunk."""

    start: int
    end: int
    grad_start: int
    count: int


class FlatOptimizer(torch.optim.Optimizer):
    """``optimizer_class`` (``torch.optim.AdamW``, ``Adam`` or ``SGD``) stepping every fsdp group of
    ``params`` as one flat tensor (module docstring).

    ``params``: a sharded module, its parameters, or param-group dicts each holding whole fsdp
    groups (frozen parameters skipped); one param group per dict, so LR schedulers work unchanged.
    ``options``: ``optimizer_class``'s, validated by it; ``fused``/``foreach`` unset: fused on CUDA
    (:func:`~fsdp.optim.flat_kernels.fused_by_default`). ``chunk_numel``: elements per kernel call
    (and per host copy when offloaded), bounding the temporaries; default: one parameter's largest
    local piece, as torch.optim. ``state_dtype``: None (the main weights' dtype), float32, or
    ``torch.bfloat16`` (half the state's memory; chunks are upcast, stepped and rounded back to
    nearest). Build it after ``fully_shard`` and any ``module.to(dtype)``; ``state_dict()`` holds
    this rank's flat shard (same world size and layout only).

    Raises ``TypeError`` for another ``optimizer_class``, a single tensor, a trainable parameter not
    sharded by fsdp, or an unsharded (gathered) one; ``ValueError`` for no trainable sharded
    parameter, a ``chunk_numel`` that is not a positive int, a ``state_dtype`` other than None,
    float32 or bfloat16 (or with offloaded state), or an fsdp group split across param groups or
    passed in part (give it its own :class:`fsdp.Bucket`).

    With torch.optim's implementation (the CPU default) and state dtype, results match it bit for
    bit where the kernels round independently of position, else to rounding. ``clip_grad_norm_``
    clips what it steps; ``zero_grad()`` drops (``set_to_none=True``) or zeroes every group's
    main grads.
    """

    def __init__(
        self,
        params: Union[nn.Module, Iterable[Any]],
        optimizer_class: type = torch.optim.AdamW,
        *,
        chunk_numel: Optional[int] = None,
        state_dtype: Optional[torch.dtype] = None,
        **options: Any,
    ) -> None:
        kernel = KERNELS.get(optimizer_class)
        if kernel is None:
            raise TypeError(
                f"FlatOptimizer: optimizer_class must be one of {', '.join(c.__name__ for c in KERNELS)}, "
                f"got {getattr(optimizer_class, '__name__', optimizer_class)!r}; for another optimizer use it "
                f"on model.parameters() (torch.optim works on fsdp's DTensor parameters)"
            )
        if chunk_numel is not None and (
            not isinstance(chunk_numel, int) or isinstance(chunk_numel, bool) or chunk_numel < 1
        ):
            raise ValueError(f"FlatOptimizer: chunk_numel must be a positive int, got {chunk_numel!r}")
        if state_dtype not in (None, torch.float32, torch.bfloat16):
            raise ValueError(
                f"FlatOptimizer: state_dtype must be None (the main weights' dtype), torch.float32 or "
                f"torch.bfloat16, got {state_dtype!r}"
            )
        # optimizer_class validates the options and fills in its defaults
        probe = optimizer_class([torch.zeros(1)], **options)
        defaults = dict(probe.defaults)
        specs = param_specs(params)
        self._kernel = kernel
        self._state_dtype = state_dtype
        self._groups: dict[int, ParameterGroup] = {}  # id(flat main buffer) -> its group
        self._layouts: dict[int, list[Span]] = {}  # id(flat) -> where each parameter lies in it
        flat_groups = []
        for options_of_dict, fsdp_groups in specs:
            flats = []
            for g in fsdp_groups:
                flat = g.main.local_buffer
                self._groups[id(flat)] = g
                self._layouts[id(flat)] = spans(g)
                flats.append(flat)
            flat_groups.append({**options_of_dict, "params": flats})
        super().__init__(flat_groups, defaults)
        if chunk_numel is None:
            chunk_numel = max((span.numel for spans in self._layouts.values() for span in spans), default=1)
        self._chunk_numel = max(chunk_numel, 1)
        self._homes: dict[int, dict] = {}  # id(flat) -> its host state tensors (OptimizerStateOffloadPolicy)
        offloaded = any(g.offload.optim_state is not None for g in self._groups.values())
        if offloaded:  # refused before the groups are changed
            if state_dtype is not None:
                raise ValueError(
                    "FlatOptimizer: state_dtype with fsdp.OptimizerStateOffloadPolicy is not supported "
                    "(the state streams through the device in the main weights' dtype); pass one of them"
                )
            for i, opts in enumerate(self.param_groups):
                homes = [self._groups[id(flat)].offload.optim_state for flat in opts["params"]]
                if opts.get("capturable") and any(h is not None and h.step_on == "host" for h in homes):
                    raise ValueError(
                        f"FlatOptimizer: param_groups[{i}] has capturable=True, which needs the weights on the "
                        f"device; fsdp.OptimizerStateOffloadPolicy(step='host') steps them on the host: build "
                        f"the optimizer with capturable=False, or use step='device'"
                    )
        for g in self._groups.values():
            g.grads.cast_grads = False  # no full-size cast copy in param.grad: step() upcasts by chunks
        if offloaded:
            self.register_load_state_dict_post_hook(FlatOptimizer._rehome_loaded)
        elif state_dtype is not None:
            self.register_load_state_dict_post_hook(FlatOptimizer._recast_loaded)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):
        """One step over every group's flat shard; returns the ``closure``'s loss, or None."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        plans = [(opts, self._plan(flat)) for opts in self.param_groups for flat in opts["params"]]
        longest = max((run.end - run.start for _, (_, _, runs) in plans for run in runs), default=0)
        workspace = Workspace(min(self._chunk_numel, longest))
        for opts, (flat, group, runs) in plans:
            if not runs:
                continue
            state = self._state_for(flat, group, opts)
            grads = group.grads.main_grad.local_buffer
            # a released model shard is not written: the next refresh casts it whole
            model = None
            weights = group.weights
            if weights.step_writes_model and not weights.model.is_storage_released():
                model = weights.model.local_buffer
            home = group.offload.optim_state
            opts = self._implementation(opts, flat.device, home is None)
            # fused with nothing to upcast: no temporaries to bound, so a run is one kernel call
            whole = home is None and opts["fused"] and grads.dtype == (self._state_dtype or flat.dtype) == flat.dtype
            chunks = self._chunks(runs, max(run.end - run.start for run in runs) if whole else self._chunk_numel)
            if home is None:
                for c in chunks:
                    states = {name: state[name][c.start : c.end] for name in self._kernel.state_names(opts)}
                    self._step_chunk(flat[c.start : c.end], grads[c.grad_start : c.grad_start + c.numel], states, c, opts, workspace)
                    if model is not None:
                        model[c.start : c.end].copy_(flat[c.start : c.end])
            else:  # the state on the host: streamed through the device, or stepped there
                written = flat_offloaded_step(
                    home, self._kernel.state_names(opts), flat, grads, model, state, chunks,
                    lambda w, g, states, c, opts=opts: self._step_chunk(w, g, states, c, opts, workspace),
                )
                model = model if written else None
            for k in group.grads.params_with_grads():
                state["steps"][k] += 1
            group.unsharder.mark_stale(model_written=model is not None)
        for _, (_, group, _) in plans:
            group.offload.settle()  # no copy of an offloaded state is in flight once step() returns
        return loss

    def _plan(self, flat: torch.Tensor) -> tuple[torch.Tensor, ParameterGroup, list[_Run]]:
        """The runs of parameters to step in ``flat``'s group (none without reduced gradients)."""
        group = self._groups[id(flat)]
        if group.main.local_buffer is not flat:
            raise RuntimeError(
                f"FlatOptimizer: the buffers of parameters {group.names()} were rebuilt since the optimizer "
                f"was made (module.to(dtype)?); build the optimizer again after converting the module"
            )
        with_grads = group.grads.params_with_grads()
        if not with_grads or group.grads.main_grad.is_storage_released():
            return flat, group, []
        spans = self._layouts[id(flat)]
        steps = self.state[flat].get("steps") if flat in self.state else None
        runs: list[_Run] = []
        for k in with_grads:
            span, count = spans[k], (steps[k] if steps is not None else 0)
            if span.numel == 0:
                continue
            last = runs[-1] if runs else None
            if (
                last is not None
                and last.count == count
                and last.end == span.start
                and last.grad_start + (last.end - last.start) == span.grad_start
            ):
                runs[-1] = _Run(last.start, span.start + span.numel, last.grad_start, count)
            else:
                runs.append(_Run(span.start, span.start + span.numel, span.grad_start, count))
        return flat, group, runs

    def _state_for(self, flat: torch.Tensor, group: ParameterGroup, opts: dict) -> dict:
        state, home = self.state[flat], group.offload.optim_state
        if not state:
            state["steps"] = [0] * len(group.infos)
            if home is None:
                for name in self._kernel.state_names(opts):
                    state[name] = torch.zeros_like(flat, dtype=self._state_dtype or flat.dtype)
        if home is not None:  # host tensors (made here, or a loaded state dict's copied in)
            rehome_flat(home, state, self._kernel.state_names(opts), flat, self._homes.setdefault(id(flat), {}))
        return state

    def _rehome_loaded(self) -> None:
        """After ``load_state_dict``: offloaded groups' loaded state into their host tensors."""
        for opts in self.param_groups:
            for flat in opts["params"]:
                if self.state.get(flat):
                    self._state_for(flat, self._groups[id(flat)], opts)

    def _recast_loaded(self) -> None:
        """After ``load_state_dict`` (which casts to the parameters' dtype): to ``state_dtype``."""
        for state in self.state.values():
            for name, value in state.items():
                if torch.is_tensor(value) and value.is_floating_point() and value.dtype != self._state_dtype:
                    state[name] = value.to(self._state_dtype)

    def _implementation(self, opts: dict, device: torch.device, on_device: bool) -> dict:
        """``opts``, fused where ``fused``/``foreach`` are None and :func:`fused_by_default`
        agrees."""
        if (self._kernel.fusable and on_device and opts.get("fused") is None and opts.get("foreach") is None
                and fused_by_default(device)):
            return {**opts, "fused": True}
        return opts

    def _chunks(self, runs: list[_Run], c: int) -> list[Chunk]:
        """Each run cut into pieces of ``c`` elements, tagged with the run's step count."""
        return [
            Chunk(pos, min(pos + c, run.end), run.grad_start + pos - run.start, run.count)
            for run in runs for pos in range(run.start, run.end, c)
        ]

    def _step_chunk(self, weights, grad, states: dict, chunk: Chunk, opts: dict, workspace: "Workspace") -> None:
        if grad.dtype != weights.dtype:
            grad = workspace.upcast("grad", grad, weights.dtype)
        kept = {name: t for name, t in states.items() if t.dtype != weights.dtype}  # state_dtype
        states = {**states, **{name: workspace.upcast(name, t, weights.dtype) for name, t in kept.items()}}
        self._kernel.step(weights, grad, states, chunk.tag, opts)
        for name, t in kept.items():
            t.copy_(states[name])  # rounded to nearest

    def bytes_per_step(self) -> int:
        """The least bytes a full step reads and writes on this rank (its memory-traffic floor)."""
        total = 0
        for opts in self.param_groups:
            names = self._kernel.state_names(opts)
            for flat in opts["params"]:
                group = self._groups[id(flat)]
                numel = sum(span.numel for span in self._layouts[id(flat)])
                weights = group.weights
                shard = weights.model.local_buffer.element_size() if weights.step_writes_model else 0
                grad = group.grads.main_grad.local_buffer.element_size()
                state = (self._state_dtype or flat.dtype).itemsize
                total += numel * (2 * flat.element_size() + grad + 2 * len(names) * state + shard)
        return total

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the gradients this optimizer steps
        (``param.grad`` may be None); ``norm_type``: 2.0 or ``inf``. Returns the total norm, equal
        on every rank."""
        if norm_type not in (2.0, float("inf")):
            raise ValueError(f"FlatOptimizer.clip_grad_norm_: norm_type must be 2.0 or inf, got {norm_type!r}")
        inf = norm_type == float("inf")
        total = None
        for opts in self.param_groups:
            for flat in opts["params"]:
                _, group, runs = self._plan(flat)
                local = torch.zeros((), dtype=torch.float32, device=flat.device)
                grads = group.grads.main_grad.local_buffer
                for run in runs:
                    for pos in range(run.grad_start, run.grad_start + run.end - run.start, self._chunk_numel):
                        end = min(pos + self._chunk_numel, run.grad_start + run.end - run.start)
                        piece = grads[pos:end].float()
                        local = torch.maximum(local, piece.abs().max()) if inf else local + piece.pow(2).sum()
                reduced = reduce_over_mesh(local, group, "max" if inf else "sum")
                total = reduced if total is None else (torch.maximum(total, reduced) if inf else total + reduced)
        if total is None:
            return torch.zeros(())
        norm = total if inf else total.sqrt()
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(f"FlatOptimizer.clip_grad_norm_: the total gradient norm is {float(norm)}")
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for group in self._groups.values():
            if group.grads.params_with_grads() and not group.grads.main_grad.is_storage_released():
                buf = group.grads.main_grad.local_buffer
                buf.mul_(coef.to(buf.device))  # as torch: the fp32 coefficient in the gradients' dtype, where they are
        return norm

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop (``set_to_none``) or zero every group's reduced gradients."""
        for group in self._groups.values():
            if set_to_none:
                group.grads.drop_main_grads()
            else:
                group.grads.zero_grad_buffer()


def flat_optimizer(params, optimizer_class: type = torch.optim.AdamW, **options: Any) -> FlatOptimizer:
    """``FlatOptimizer(params, optimizer_class, **options)``: the flat step of ``optimizer_class``
    (``torch.optim.AdamW``, ``Adam`` or ``SGD``) over the fsdp groups of ``params``, with
    ``options`` for it. Raises what :class:`FlatOptimizer` raises; guarantees what it guarantees."""
    return FlatOptimizer(params, optimizer_class, **options)


class FlatAdamW(FlatOptimizer):
    """:class:`FlatOptimizer` with ``torch.optim.AdamW``, e.g. ``FlatAdamW(model, lr=3e-4)``:
    ``params`` and what it raises as there; ``options``: ``torch.optim.AdamW``'s. In fp32 the
    weights equal ``torch.optim.AdamW``'s bit for bit."""

    def __init__(self, params, **options: Any) -> None:
        super().__init__(params, torch.optim.AdamW, **options)


class FlatAdam(FlatOptimizer):
    """:class:`FlatOptimizer` with ``torch.optim.Adam``: ``params`` and what it raises as there;
    ``options``: ``torch.optim.Adam``'s (validated by it). In fp32 the weights equal
    ``torch.optim.Adam``'s bit for bit."""

    def __init__(self, params, **options: Any) -> None:
        super().__init__(params, torch.optim.Adam, **options)


class FlatSGD(FlatOptimizer):
    """:class:`FlatOptimizer` with ``torch.optim.SGD``: ``params`` and what it raises as there;
    ``options``: ``torch.optim.SGD``'s (validated by it). In fp32 the weights equal
    ``torch.optim.SGD``'s bit for bit."""

    def __init__(self, params, **options: Any) -> None:
        super().__init__(params, torch.optim.SGD, **options)
