"""megatron-core on the CPU: stand-ins for what it does only on CUDA (none of it data
parallelism), and its GPTModel built the way ``test_megatron_core.py`` trains it.

megatron-core 0.16.1 names CUDA in a few places its training loop passes through. Within
:func:`cuda_standins` (and only there: every patch is undone on exit):

* ``GlobalMemoryBuffer.get_tensor`` (the local attention's matmul input, in every layer) and the
  pipeline's p2p receive buffers allocate on ``torch.cuda.current_device()``: the current device
  is the CPU;
* the CUDA RNG tracker's ``fork`` and ``tensor_parallel.checkpoint``'s state save and restore call
  ``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state``: they get and set the
  CPU generator's state (the generator CPU operators draw from). The tracker's state itself is set
  with its public ``set_states`` (:func:`seed_rng_tracker`) instead of
  ``model_parallel_cuda_manual_seed``, which seeds CUDA;
* the schedules (``total_num_tokens = torch.zeros(..., device="cuda")``) and the FP32 optimizer's
  loss scale create tensors with ``device="cuda"``: :class:`CudaFactoriesOnCpu` (a
  ``TorchFunctionMode``) creates them on the CPU;
* ``TorchFullyShardedDataParallel`` builds its mesh as ``DeviceMesh.from_group(group, "cuda")``:
  a CPU mesh of the same group.

:func:`import_megatron` takes out the one process-wide change ``import megatron.core`` makes (its
entries in ``torch.load``'s ``weights_only`` allow-list): the test workers run other tests after.

One stand-in is not about CUDA: megatron-core 0.16.1's ``finalize_model_grads`` calls
``model_chunk.finish_grad_sync(force_all_reduce=...)``, which ``TorchFullyShardedDataParallel``
inherits from ``_BaseDataParallel`` without that argument (a ``TypeError`` on any device);
:func:`data_parallel_class` accepts it and does what the base does (nothing: FSDP2, and fsdp
under its names, reduce in backward).

Which ``fully_shard`` megatron-core calls is decided where it binds the name:
``megatron.core.distributed.torch_fully_sharded_data_parallel`` runs
``from torch.distributed.fsdp import fully_shard`` at import, so a Megatron-LM user switches
``fsdp.torch_names()`` on before importing megatron. A test process trains both FSDP2 and fsdp,
so :func:`data_parallel_class` re-imports that module (``importlib.reload``) with the switch as
wanted, which is what a fresh process importing it after the switch gets.

Everything else is megatron-core's own code; nothing of it is copied here.
"""

from __future__ import annotations

import contextlib
import importlib
import zlib
from typing import Any, Iterator

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.overrides import TorchFunctionMode

import fsdp

__all__ = [
    "CudaFactoriesOnCpu", "LAYERS", "SEQ", "VOCAB", "build_config", "build_gpt", "cuda_standins",
    "data_parallel_class", "global_names", "import_megatron", "init_by_name", "seed_rng_tracker",
]

VOCAB, SEQ, HIDDEN, HEADS, LAYERS = 64, 16, 32, 4, 2
_WRAPPER = "megatron.core.distributed.torch_fully_sharded_data_parallel"


class CudaFactoriesOnCpu(TorchFunctionMode):
    """Tensors created with ``device="cuda"`` (or a CUDA ``torch.device``) are created on the CPU;
    every other call is unchanged."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_standins() -> Iterator[None]:
    """megatron-core's CUDA-only calls on the CPU (see the module docstring), undone on exit."""
    from megatron.core.tensor_parallel import random as mrandom

    saved = (torch.cuda.current_device, mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state, DeviceMesh.from_group)
    from_group = DeviceMesh.from_group

    def cpu_mesh(group, device_type, *args, **kwargs):
        return from_group(group, "cpu", *args, **kwargs)

    torch.cuda.current_device = lambda: torch.device("cpu")
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    DeviceMesh.from_group = staticmethod(cpu_mesh)
    try:
        with CudaFactoriesOnCpu():
            yield
    finally:
        torch.cuda.current_device, mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state = saved[:3]
        DeviceMesh.from_group = saved[3]


def import_megatron() -> None:
    """Import megatron-core without the one process-wide change its import makes: ``megatron.core``
    adds its classes, and numpy's arrays, ``argparse.Namespace``, ``BytesIO``, ``PosixPath``, ...
    to ``torch.load``'s ``weights_only`` allow-list (``torch.serialization.add_safe_globals``).
    The gloo workers run other tests after these, whose loads must accept and refuse exactly what
    they would in a process that never imported megatron: its entries are taken out again."""
    import sys

    if "megatron.core" in sys.modules:
        return
    import megatron.core
    from megatron.core.safe_globals import SAFE_GLOBALS

    ours = set(map(id, SAFE_GLOBALS))
    kept = [g for g in torch.serialization.get_safe_globals() if id(g if not isinstance(g, tuple) else g[0]) not in ours]
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals(kept)


def seed_rng_tracker() -> None:
    """The model-parallel RNG state megatron forks for dropout and initialisation, as
    ``model_parallel_cuda_manual_seed`` would add it, from the CPU generator."""
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.get_cuda_rng_tracker().set_states({mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME: torch.get_rng_state()})


def data_parallel_class(impl: str) -> type:
    """megatron-core's ``TorchFullyShardedDataParallel`` calling torch FSDP2's ``fully_shard``
    (``impl="fsdp2"``) or, imported under ``fsdp.torch_names()``, fsdp's (``"fsdp"``), with
    ``finish_grad_sync`` accepting ``force_all_reduce`` (see the module docstring)."""
    with fsdp.torch_names(impl == "fsdp"):
        module = importlib.reload(importlib.import_module(_WRAPPER))
    base = module.TorchFullyShardedDataParallel

    class TorchFullyShardedDataParallel(base):
        def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
            return super().finish_grad_sync()

    return TorchFullyShardedDataParallel


def build_config(dtype: torch.dtype, recompute: bool = False, pipeline_stages: int = 1) -> Any:
    """A tiny GPT's TransformerConfig: local (non-Transformer-Engine) layers, no dropout, no
    fused CUDA kernels; ``recompute``: full activation recompute of every layer
    (``tensor_parallel.checkpoint``)."""
    from megatron.core.transformer import TransformerConfig

    extra: dict[str, Any] = {}
    if recompute:
        extra.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if pipeline_stages > 1:  # batch_p2p_sync would call torch.cuda.synchronize()
        extra.update(pipeline_model_parallel_size=pipeline_stages, pipeline_dtype=dtype, batch_p2p_sync=False)
    return TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, transformer_impl="local", masked_softmax_fusion=False,
        bias_dropout_fusion=False, gradient_accumulation_fusion=False, bf16=dtype == torch.bfloat16,
        params_dtype=dtype, **extra,
    )


def build_gpt(config: Any, tied: bool, pre_process: bool = True, post_process: bool = True) -> torch.nn.Module:
    """megatron-core's GPTModel on the local layer spec (``init_by_name``'s values), wrapped in
    ``Float16Module`` for bf16, as Megatron-LM wraps a bf16 model."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.module import Float16Module

    model = GPTModel(
        config, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ,
        pre_process=pre_process, post_process=post_process, share_embeddings_and_output_weights=tied,
    )
    init_by_name(model)
    return Float16Module(config, model) if config.bf16 else model


def global_names(model: torch.nn.Module) -> dict[str, str]:
    """Each parameter's name in the whole GPTModel, by its name in ``model`` (the GPTModel, or a
    ``Float16Module`` / data-parallel wrapper of it: their ``module.`` prefixes dropped; a
    pipeline stage numbers its layers from 0, their global number is ``layer_number``)."""
    inner, prefix = model, ""
    while isinstance(getattr(inner, "module", None), torch.nn.Module):
        inner, prefix = inner.module, prefix + "module."
    offsets = {}
    for k, layer in enumerate(getattr(getattr(inner, "decoder", None), "layers", [])):
        offsets[f"decoder.layers.{k}."] = f"decoder.layers.{layer.layer_number - 1}."
    out = {}
    for name, _ in model.named_parameters():
        local = name.removeprefix(prefix)
        out[name] = next((local.replace(a, b, 1) for a, b in offsets.items() if local.startswith(a)), local)
    return out


@torch.no_grad()
def init_by_name(model: torch.nn.Module) -> None:
    """Every matrix drawn from a generator seeded by its name in the whole model
    (:func:`global_names`), so every run and every stage of a pipeline starts from the same
    weights; vectors keep megatron's init (norms one, biases zero)."""
    names = global_names(model)
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            g = torch.Generator().manual_seed(zlib.crc32(names[name].encode()))
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
