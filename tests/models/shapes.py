"""Parameter shapes of published models, in registration order, without building them.

Shapes come from the public model configs and follow Hugging Face module registration order
(embedding; per layer: q, k, v, o, then the MLP or MoE, then the two RMSNorm weights; final norm;
lm_head), because a DBuffer's layout order is registration order. Mixtral uses per-expert weights
(w1, w2, w3 per expert, as in the Hugging Face model); "Mixtral-8x7B-stacked" stacks each into
``[E, ...]`` (a row becomes a whole expert matrix, 58.7M elements).

Used by tests/dbuffer/test_layout.py and by tools/padding_report.py, draw_layout.py, bench_muon.py.
"""

from __future__ import annotations

from typing import Optional

Shape = tuple[int, ...]

# name: (vocab, dim, layers, heads, kv_heads, head_dim, ffn, experts)
_CONFIGS: dict[str, tuple[int, int, int, int, int, int, int, int]] = {
    "Llama-3-8B": (128256, 4096, 32, 32, 8, 128, 14336, 0),
    "Llama-3-70B": (128256, 8192, 80, 64, 8, 128, 28672, 0),
    "Mixtral-8x7B": (32000, 4096, 32, 32, 8, 128, 14336, 8),
    "Mixtral-8x7B-stacked": (32000, 4096, 32, 32, 8, 128, 14336, 8),
}
MODELS = tuple(_CONFIGS)


def model_shapes(name: str) -> list[Shape]:
    """Parameter shapes of ``name`` (one of :data:`MODELS`) in registration order."""
    if name not in _CONFIGS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    vocab, dim, layers, heads, kv_heads, head_dim, ffn, experts = _CONFIGS[name]
    shapes: list[Shape] = [(vocab, dim)]  # embed_tokens
    for _ in range(layers):
        shapes += [
            (heads * head_dim, dim),  # q_proj
            (kv_heads * head_dim, dim),  # k_proj
            (kv_heads * head_dim, dim),  # v_proj
            (dim, heads * head_dim),  # o_proj
        ]
        if experts == 0:
            shapes += [(ffn, dim), (ffn, dim), (dim, ffn)]  # gate_proj, up_proj, down_proj
        elif name.endswith("-stacked"):
            shapes += [(experts, dim), (experts, ffn, dim), (experts, dim, ffn), (experts, ffn, dim)]
        else:
            shapes.append((experts, dim))  # router
            for _ in range(experts):
                shapes += [(ffn, dim), (dim, ffn), (ffn, dim)]  # w1, w2, w3
        shapes += [(dim,), (dim,)]  # input_layernorm, post_attention_layernorm
    shapes += [(dim,), (vocab, dim)]  # final norm, lm_head (untied)
    return shapes


def model_tp_dims(name: str) -> list[Optional[int]]:
    """For each of :func:`model_shapes`, the dim tools/tp_plan.py's Llama TP plan splits it on
    (None: replicated on the TP ranks), in the same order."""
    if name not in _CONFIGS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    layers, experts = _CONFIGS[name][2], _CONFIGS[name][7]
    layer: list[Optional[int]] = [0, 0, 0, 1]  # q, k, v colwise; o rowwise
    if experts == 0:
        layer += [0, 0, 1]  # gate, up colwise; down rowwise
    elif name.endswith("-stacked"):
        layer += [None, 1, 2, 1]  # router; stacked w1 [E, ffn, dim], w2 [E, dim, ffn], w3
    else:
        layer += [None] + [0, 1, 0] * experts  # router; w1, w3 colwise, w2 rowwise
    layer += [None, None]  # norms
    return [0] + layer * layers + [None, 0]  # embedding (vocab), ..., final norm, lm_head (vocab)


def unit_shapes(name: str) -> list[list[Shape]]:
    """The shapes of each ``fully_shard`` unit as ``tools/demo.py`` shards a model: one per
    decoder layer, then the root (embedding, final norm, lm_head)."""
    shapes = model_shapes(name)
    layers = _CONFIGS[name][2]
    per = (len(shapes) - 3) // layers
    blocks = [shapes[1 + i * per : 1 + (i + 1) * per] for i in range(layers)]
    return blocks + [[shapes[0], shapes[-2], shapes[-1]]]
