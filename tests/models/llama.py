"""A small Llama-style decoder in plain ``torch.nn``, for examples, tests and benchmarks.

    from tests.models.llama import Llama, LlamaConfig, loss_fn

    model = Llama(LlamaConfig())          # 28,842,496 parameters with the defaults
    logits = model(tokens[:, :-1])        # tokens: LongTensor [batch, seq_len + 1]
    loss = loss_fn(logits, tokens)        # next-token cross-entropy

Architecture: token embedding, ``n_layers`` pre-norm residual :class:`Block` s (RMSNorm ->
causal multi-head attention with rotary position embeddings -> residual add; RMSNorm -> SwiGLU
MLP -> residual add), a final RMSNorm and an untied ``lm_head``. No biases. With
``tie_embeddings=True`` the output projection reuses the embedding matrix (there is no
``lm_head`` module at all, so no parameter is shared between modules) and the final hidden
state is scaled by ``dim ** -0.5`` first, so that the logits of an N(0, 1) embedding start
near unit scale.

Parameter count, with V = vocab_size, D = dim, L = n_layers, F = hidden_dim::

    (1 if tie_embeddings else 2) * V * D  +  L * (4 * D * D + 3 * D * F + 2 * D)  +  D

Defaults (V=8192, D=512, L=6, F=1536): 28,842,496 parameters untied, 24,648,192 tied.
Registration order (which is a DBuffer's element order): ``tok_embeddings``, then per block
``attention_norm``, ``attention.{wq, wk, wv, wo}``, ``mlp_norm``, ``mlp.{w_gate, w_up, w_down}``,
then ``norm``, ``lm_head``.

``model.layers`` is an ``nn.ModuleList`` of blocks, so each block can be sharded on its own::

    for block in model.layers:
        fully_shard(block)
    fully_shard(model)

Meta-device initialization. Every module that owns a parameter or buffer has a
``reset_parameters()`` that resets exactly its own tensors (``nn.Linear`` and ``nn.Embedding``
already do; :class:`RMSNorm` and :class:`RotaryEmbedding` are defined here; the rotary tables are
non-persistent buffers, so they are not in the state dict and are recomputed there)::

    with torch.device("meta"):
        model = Llama(cfg)
    model.to_empty(device="cpu")
    model.init_weights()      # reset_parameters() of every submodule, in registration order

Construction on a real device initializes the modules in that same order, so under the same
``torch.manual_seed`` both paths give bitwise-identical weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LlamaConfig", "RMSNorm", "RotaryEmbedding", "Attention", "FeedForward", "Block", "Llama", "loss_fn"]


@dataclass
class LlamaConfig:
    vocab_size: int = 8192
    dim: int = 512
    n_layers: int = 6
    n_heads: int = 8
    hidden_dim: int = 1536  # SwiGLU inner width
    max_seq_len: int = 128
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "hidden_dim", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"LlamaConfig.{name} must be a positive int, got {value!r}")
        if self.dim % self.n_heads:
            raise ValueError(f"LlamaConfig.dim={self.dim} must be divisible by n_heads={self.n_heads}")
        if self.head_dim % 2:
            raise ValueError(
                f"head_dim = dim // n_heads = {self.head_dim} must be even for rotary embeddings; "
                "change dim or n_heads"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def num_parameters(self) -> int:
        """Closed-form parameter count (see the module docstring)."""
        v, d, f = self.vocab_size, self.dim, self.hidden_dim
        per_block = 4 * d * d + 3 * d * f + 2 * d
        return (1 if self.tie_embeddings else 2) * v * d + self.n_layers * per_block + d


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, computed in float32 and returned in the input's dtype."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


class RotaryEmbedding(nn.Module):
    """Cosine and sine tables for rotary position embeddings, ``[max_seq_len, head_dim // 2]``.

    The tables are non-persistent buffers: they follow ``.to()`` and ``to_empty()`` but are not
    saved in the state dict; :meth:`reset_parameters` recomputes them where they live.
    """

    def __init__(self, head_dim: int, max_seq_len: int, theta: float = 10000.0) -> None:
        super().__init__()
        self.head_dim, self.max_seq_len, self.theta = head_dim, max_seq_len, theta
        self.register_buffer("cos", torch.empty(max_seq_len, head_dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq_len, head_dim // 2), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        device = self.cos.device
        if device.type == "meta":
            return  # nothing to compute yet; to_empty() then reset_parameters() fills the tables
        half = self.head_dim // 2
        inv_freq = self.theta ** (-torch.arange(half, dtype=torch.float64, device=device) / half)
        angles = torch.outer(torch.arange(self.max_seq_len, dtype=torch.float64, device=device), inv_freq)
        with torch.no_grad():
            self.cos.copy_(angles.cos())
            self.sin.copy_(angles.sin())

    def forward(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[:seq_len], self.sin[:seq_len]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs ``(x[..., j], x[..., j + half])`` by angle ``position * inv_freq[j]``.

    ``x`` is ``[batch, heads, seq, head_dim]``; ``cos`` and ``sin`` are ``[seq, head_dim // 2]``.
    """
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


class Attention(nn.Module):
    """Causal multi-head self-attention with rotary embeddings on queries and keys."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # [batch, seq, dim] -> [batch, heads, seq, head_dim]
            return t.view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)

        q = apply_rotary(heads(self.wq(x)), cos, sin)
        k = apply_rotary(heads(self.wk(x)), cos, sin)
        v = heads(self.wv(x))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, dim))


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w_down(silu(w_gate(x)) * w_up(x))``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w_gate = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.w_up = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.w_down = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    """One pre-norm decoder layer: ``h = x + attn(norm(x))``, ``out = h + mlp(norm(h))``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.mlp(self.mlp_norm(h))


class Llama(nn.Module):
    """Decoder-only language model: ``forward(tokens [batch, seq]) -> logits [batch, seq, vocab]``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def init_weights(self) -> None:
        """Reset every parameter and buffer: ``reset_parameters()`` of each submodule, in
        registration order (the order construction uses), e.g. after ``to_empty()``."""
        for module in self.modules():
            if module is not self and callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
        seq = tokens.shape[1]
        if seq > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence length {seq} exceeds max_seq_len={self.cfg.max_seq_len}; "
                "feed shorter sequences or raise LlamaConfig.max_seq_len"
            )
        cos, sin = self.rope(seq)
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        h = self.norm(h)
        if self.lm_head is not None:
            return self.lm_head(h)
        return F.linear(h * self.cfg.dim**-0.5, self.tok_embeddings.weight)


def loss_fn(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy: ``logits[:, t]`` predicts ``tokens[:, t + 1]``.

    ``tokens`` is ``[batch, T]``; ``logits`` is ``[batch, T - 1, vocab]`` (the model ran on
    ``tokens[:, :-1]``, the usual case) or ``[batch, T, vocab]`` (it ran on all of ``tokens``;
    the last position, which has no target, is ignored). Computed in float32.
    """
    if logits.dim() != 3 or tokens.dim() != 2 or logits.shape[0] != tokens.shape[0]:
        raise ValueError(
            f"expected logits [batch, seq, vocab] and tokens [batch, T], got {tuple(logits.shape)} "
            f"and {tuple(tokens.shape)}"
        )
    steps = tokens.shape[1] - 1
    if logits.shape[1] not in (steps, steps + 1):
        raise ValueError(
            f"logits cover {logits.shape[1]} positions; for tokens of length {steps + 1} they must "
            f"cover {steps} (model(tokens[:, :-1])) or {steps + 1} (model(tokens))"
        )
    predictions = logits[:, :steps].float()
    return F.cross_entropy(predictions.reshape(-1, predictions.shape[-1]), tokens[:, 1:].reshape(-1))
