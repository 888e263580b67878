"""The planner's model presets: decoder-only transformers built from their shapes alone (Hugging
Face Llama / Mixtral names and order), never run or initialised, so any size builds on meta in
milliseconds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

import torch
import torch.nn as nn


@dataclass(frozen=True)
class Config:
    """A decoder-only transformer's shapes (Hugging Face Llama / Mixtral names and order)."""

    name: str
    vocab: int
    dim: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    experts: int = 0  # 0: dense SwiGLU MLP; else per-expert SwiGLU weights and a router


class Weight(nn.Module):
    """A module holding one uninitialised ``weight`` (a Linear, Embedding or norm, shapes only):
    the planner never runs forward or init, and ``nn.Embedding``'s init on meta alone would
    import torch._dynamo (2 s)."""

    def __init__(self, *shape: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape))


class Linear(nn.Linear):
    """An ``nn.Linear`` without bias or init: shapes only, but an ``nn.Linear``, so that torch's
    ``parallelize_module`` (which dispatches on the module type) can apply a TP plan to it."""

    def reset_parameters(self) -> None:
        pass


class Embedding(nn.Embedding):
    """An ``nn.Embedding`` without init (its init on meta would import torch._dynamo, 2 s)."""

    def reset_parameters(self) -> None:
        pass


def _linear(fan_in: int, fan_out: int) -> Linear:
    return Linear(fan_in, fan_out, bias=False)  # weight [out, in]


class Attention(nn.Module):
    """Grouped-query attention projections: ``kv_heads`` key/value heads shared by the queries."""

    def __init__(self, c: Config) -> None:
        super().__init__()
        head_dim = c.dim // c.heads
        self.q_proj = _linear(c.dim, c.heads * head_dim)
        self.k_proj = _linear(c.dim, c.kv_heads * head_dim)
        self.v_proj = _linear(c.dim, c.kv_heads * head_dim)
        self.o_proj = _linear(c.heads * head_dim, c.dim)


class MLP(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = _linear(c.dim, c.ffn), _linear(c.dim, c.ffn)
        self.down_proj = _linear(c.ffn, c.dim)


class Expert(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = _linear(c.dim, c.ffn), _linear(c.ffn, c.dim), _linear(c.dim, c.ffn)


class SparseMoE(nn.Module):
    """A router and separate per-expert weights (stacking experts would make a row an expert)."""

    def __init__(self, c: Config) -> None:
        super().__init__()
        self.gate = _linear(c.dim, c.experts)
        self.experts = nn.ModuleList(Expert(c) for _ in range(c.experts))


class DecoderLayer(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.self_attn = Attention(c)
        if c.experts:
            self.block_sparse_moe = SparseMoE(c)
        else:
            self.mlp = MLP(c)
        self.input_layernorm = Weight(c.dim)
        self.post_attention_layernorm = Weight(c.dim)


class CausalLM(nn.Module):
    """Shapes only: the planner never runs forward, so none is defined."""

    def __init__(self, c: Config) -> None:
        super().__init__()
        self.embed_tokens = Embedding(c.vocab, c.dim)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.layers))
        self.norm = Weight(c.dim)
        self.lm_head = _linear(c.dim, c.vocab)  # untied


CONFIGS = {
    "llama3-8b": Config("Llama-3-8B", 128256, 4096, 32, 32, 8, 14336),
    "llama3-70b": Config("Llama-3-70B", 128256, 8192, 80, 64, 8, 28672),
    "mixtral-8x7b": Config("Mixtral-8x7B", 32000, 4096, 32, 32, 8, 14336, experts=8),
}
PRESETS: dict[str, Callable[[], nn.Module]] = {key: (lambda c=c: CausalLM(c)) for key, c in CONFIGS.items()}


def resolve_model(model: Union[str, Callable[[], nn.Module]]) -> tuple[str, Callable[[], nn.Module]]:
    if isinstance(model, str):
        key = model.lower().replace("-", "").replace("_", "").replace(".", "")
        for name, c in CONFIGS.items():
            if key in (name.replace("-", ""), c.name.lower().replace("-", "")):
                return c.name, PRESETS[name]
        raise ValueError(f"unknown model preset {model!r}; use one of {', '.join(CONFIGS)} or pass a callable")
    if not callable(model):
        raise TypeError(f"model must be a preset name or a callable building an nn.Module, got {type(model).__name__}")
    return getattr(model, "__name__", type(model).__name__), model
