"""tests/models/llama.py (the tools' model), tools/text_data.py, tools/draw_layout.py, and the rule
that imports point from tools/ to the library and tests/models/, never back."""

from __future__ import annotations

import ast
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dbuffer.layout import compute_layout
from tests.hypothesis_profiles import examples
from tests.models.llama import Llama, LlamaConfig, loss_fn
from tests.models.shapes import model_shapes
from tools.draw_layout import main as draw_main
from tools.draw_layout import parse_shapes, segments, tp_shapes, truncate_layers
from tools.text_data import ByteText

ROOT = Path(__file__).resolve().parents[2]
SMALL = LlamaConfig(vocab_size=300, dim=64, n_layers=2, n_heads=4, hidden_dim=96, max_seq_len=32)


# ---------------------------------------------------------------- llama


@pytest.mark.parametrize("tie", [False, True])
def test_default_parameter_count_matches_closed_form(tie: bool) -> None:
    cfg = LlamaConfig(tie_embeddings=tie)
    with torch.device("meta"):
        model = Llama(cfg)
    v, d, layers, f = 8192, 512, 6, 1536  # written out, independent of the config's helper
    per_block = 4 * d * d + 3 * d * f + 2 * d  # q, k, v, o; gate, up, down; two norms
    expected = (1 if tie else 2) * v * d + layers * per_block + d
    assert sum(p.numel() for p in model.parameters()) == expected == cfg.num_parameters()
    assert expected == (24_648_192 if tie else 28_842_496)
    assert len(list(model.parameters())) == 1 + 9 * layers + 1 + (0 if tie else 1)


def test_meta_init_matches_direct_cpu_construction() -> None:
    torch.manual_seed(123)
    direct = Llama(SMALL)
    with torch.device("meta"):
        model = Llama(SMALL)
    model.to_empty(device="cpu")
    torch.manual_seed(123)
    for module in model.modules():  # what a meta-device init (e.g. FSDP's) does
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    ref, got = direct.state_dict(), model.state_dict()
    assert ref.keys() == got.keys()
    for name in ref:
        assert torch.equal(ref[name], got[name]), name
    assert torch.equal(model.rope.cos, direct.rope.cos) and torch.equal(model.rope.sin, direct.rope.sin)
    tokens = torch.randint(0, SMALL.vocab_size, (3, 20), generator=torch.Generator().manual_seed(0))
    out = model(tokens)
    assert out.shape == (3, 20, SMALL.vocab_size) and torch.isfinite(out).all()
    assert torch.equal(out, direct(tokens))


@pytest.mark.parametrize("tie", [False, True])
def test_causal_future_tokens_do_not_change_earlier_logits(tie: bool) -> None:
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**{**SMALL.__dict__, "tie_embeddings": tie}))
    tokens = torch.randint(0, SMALL.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    changed = tokens.clone()
    changed[:, 9] = (changed[:, 9] + 1) % SMALL.vocab_size
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :9], b[:, :9], rtol=0, atol=1e-5)
    assert (a[:, 9:] - b[:, 9:]).abs().amax(dim=-1).min() > 1e-4  # every later position sees it


def test_rotary_makes_attention_order_aware() -> None:
    # One layer: without position information the last position's output would not change
    # when two earlier tokens swap places (its attention sees the same keys and values).
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**{**SMALL.__dict__, "n_layers": 1}))
    tokens = torch.tensor([[5, 17, 42, 99, 7, 3]])
    swapped = tokens[:, [1, 0, 2, 3, 4, 5]]
    with torch.no_grad():
        a, b = model(tokens), model(swapped)
    assert (a[0, -1] - b[0, -1]).abs().amax() > 1e-3


def reference_forward(model: Llama, tokens: torch.Tensor) -> torch.Tensor:
    """The same network written out from its definition: explicit masked softmax attention,
    rotary embeddings as complex rotations of (x[j], x[j + half]) pairs, float64 throughout."""
    cfg = model.cfg
    w = {k: v.double() for k, v in model.state_dict().items()}
    batch, seq = tokens.shape
    hd, half = cfg.head_dim, cfg.head_dim // 2
    angle = torch.arange(seq, dtype=torch.float64)[:, None] * cfg.rope_theta ** (-torch.arange(half) / half)
    rotation = torch.polar(torch.ones_like(angle), angle)  # [seq, half]

    def norm(x, weight):
        return x / (x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps).sqrt() * weight

    def rope(x):  # [batch, seq, heads, hd]
        z = torch.complex(x[..., :half], x[..., half:]) * rotation[None, :, None, :]
        return torch.cat([z.real, z.imag], dim=-1)

    mask = torch.ones(seq, seq, dtype=torch.bool).tril()
    x = w["tok_embeddings.weight"][tokens]
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        h = norm(x, w[p + "attention_norm.weight"])
        q, k, v = (
            (h @ w[p + f"attention.{n}.weight"].T).view(batch, seq, cfg.n_heads, hd) for n in ("wq", "wk", "wv")
        )
        q, k = rope(q), rope(k)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
        attn = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        out = torch.einsum("bhqk,bkhd->bqhd", attn, v).reshape(batch, seq, cfg.dim)
        x = x + out @ w[p + "attention.wo.weight"].T
        h = norm(x, w[p + "mlp_norm.weight"])
        gate, up = h @ w[p + "mlp.w_gate.weight"].T, h @ w[p + "mlp.w_up.weight"].T
        x = x + (gate * torch.sigmoid(gate) * up) @ w[p + "mlp.w_down.weight"].T
    x = norm(x, w["norm.weight"])
    if cfg.tie_embeddings:
        return x * cfg.dim**-0.5 @ w["tok_embeddings.weight"].T
    return x @ w["lm_head.weight"].T


@pytest.mark.parametrize("tie", [False, True])
def test_forward_matches_written_out_reference(tie: bool) -> None:
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**{**SMALL.__dict__, "tie_embeddings": tie}))
    tokens = torch.randint(0, SMALL.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = model(tokens)
    expected = reference_forward(model, tokens)
    assert expected.abs().amax() > 0.1
    torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-4)


def test_loss_fn_matches_log_softmax_reference() -> None:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 11, (3, 6), generator=g)
    logits = torch.randn(3, 5, 11, generator=g)
    picked = logits.log_softmax(-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    expected = -picked.mean()
    torch.testing.assert_close(loss_fn(logits, tokens), expected)
    # logits for all positions: the last one is ignored
    torch.testing.assert_close(loss_fn(torch.cat([logits, torch.randn(3, 1, 11)], 1), tokens), expected)
    with pytest.raises(ValueError, match="positions"):
        loss_fn(logits[:, :3], tokens)


def test_small_llama_learns_byte_text(text: ByteText) -> None:
    torch.manual_seed(0)
    model = Llama(SMALL)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: extra threads only contend on a busy machine
    try:
        for step in range(30):
            tokens = text.batch(step, batch_size=8, seq_len=32)
            loss = loss_fn(model(tokens[:, :-1]), tokens)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    finally:
        torch.set_num_threads(threads)
    assert losses[0] > 0.9 * math.log(SMALL.vocab_size)
    assert sum(losses[-5:]) / 5 < 0.7 * losses[0], losses


# ---------------------------------------------------------------- text data


@pytest.fixture(scope="module")
def text() -> ByteText:
    return ByteText(max_bytes=1 << 20)


def test_byte_text_global_batch_is_independent_of_world_size(text: ByteText) -> None:
    full = text.batch(5, batch_size=8, seq_len=24)
    assert full.shape == (8, 25) and full.dtype == torch.long
    for world in (2, 4, 8):
        parts = [text.batch(5, 8, 24, rank=r, world_size=world) for r in range(world)]
        assert all(p.shape == (8 // world, 25) for p in parts)
        assert torch.equal(torch.cat(parts), full)
    assert torch.equal(ByteText(max_bytes=1 << 20).batch(5, 8, 24), full)  # reproducible
    assert not torch.equal(text.batch(6, 8, 24), full)  # steps differ
    assert not torch.equal(ByteText(max_bytes=1 << 20, seed=1).batch(5, 8, 24), full)  # seeds differ


def test_byte_text_rows_are_windows_of_stdlib_source(text: ByteText) -> None:
    raw = bytes(text.data.tolist())
    assert len(raw) == 1 << 20 and b"def " in raw and b"import " in raw
    rows = text.batch(0, batch_size=16, seq_len=40)
    assert 0 <= int(rows.min()) and int(rows.max()) < 256
    for row in rows:
        assert bytes(row.tolist()) in raw
    with pytest.raises(ValueError, match="multiple of world_size"):
        text.batch(0, batch_size=6, seq_len=8, rank=0, world_size=4)
    with pytest.raises(ValueError, match="rank"):
        text.batch(0, batch_size=8, seq_len=8, rank=4, world_size=4)


# ---------------------------------------------------------------- draw_layout

shape_lists = st.lists(st.lists(st.integers(0, 6), max_size=3).map(tuple), max_size=8)


@settings(max_examples=examples(60))
@given(shapes=shape_lists, num_shards=st.integers(1, 8), data=st.data())
def test_segments_tile_every_rank_and_match_item_offsets(shapes, num_shards, data) -> None:
    layout = compute_layout(shapes, num_shards)
    n = data.draw(st.sampled_from([d for d in range(1, num_shards + 1) if num_shards % d == 0]))
    rows = segments(layout, n)
    assert len(rows) == n
    pieces: dict[int, list[tuple[int, int, int]]] = {}
    padding = 0
    for k, row in enumerate(rows):
        lo, hi = layout.shard_range(k, n)
        pos = lo
        for j, (start, end, item) in enumerate(row):
            assert start == pos and end > start  # contiguous, non-empty, in order
            pos = end
            if item is None:
                padding += end - start
                assert j == 0 or row[j - 1][2] is not None  # padding pieces are merged
            else:
                pieces.setdefault(item, []).append((k, start, end))
        assert pos == hi  # covers exactly the rank's range
    assert padding == layout.padding_numel
    for i, it in enumerate(layout.items):
        mine = pieces.get(i, [])
        if it.numel == 0:
            assert mine == []
            continue
        assert [k for k, _, _ in mine] == list(layout.owners(i, n))
        assert mine[0][1] == it.offset and mine[-1][2] == it.offset + it.numel
        assert all(a[2] == b[1] for a, b in zip(mine, mine[1:]))  # one contiguous slice
        size = layout.shard_numel_for(n)
        for k, start, end in mine:
            r0, r1 = layout.item_rows(i, k, n)
            local = layout.item_local_range(i, k, n)
            assert (start - k * size, end - k * size) == local
            assert end - start == (r1 - r0) * it.row_numel


def test_truncate_layers_and_parse_shapes() -> None:
    full = model_shapes("Llama-3-8B")
    two = truncate_layers(full, 2)
    assert two == full[:1 + 2 * 9] + full[-2:]
    assert len(truncate_layers(model_shapes("Mixtral-8x7B"), 1)) == 1 + (4 + 1 + 24 + 2) + 2
    with pytest.raises(ValueError, match="between 1 and 32"):
        truncate_layers(full, 33)
    assert parse_shapes("[(4, 3), (5,), 7, ()]") == [(4, 3), (5,), (7,), ()]
    with pytest.raises(ValueError, match="non-negative"):
        parse_shapes("[(4, -1)]")


def test_draw_layout_writes_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "layout.png"
    assert draw_main(["--shapes", "[(4, 3), (5,), (7, 2), (3, 5), (6,)]", "--world", "4", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
    out2 = tmp_path / "llama.png"
    assert draw_main(["--model", "Llama-3-8B", "--layers", "1", "--world", "8", "--out", str(out2)]) == 0
    assert out2.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out3 = tmp_path / "llama_tp.png"
    assert draw_main(["--model", "Llama-3-8B", "--layers", "1", "--world", "16", "--tp", "2", "--out", str(out3)]) == 0
    assert out3.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_draw_layout_without_matplotlib_says_how_to_install(tmp_path: Path) -> None:
    code = (
        "import runpy, sys; sys.modules['matplotlib'] = None; "
        f"sys.argv = ['draw_layout.py', '--world', '2', '--out', {str(tmp_path / 'x.png')!r}]; "
        "runpy.run_path('tools/draw_layout.py', run_name='__main__')"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert run.returncode != 0
    assert "pip install -e .[pictures]" in run.stderr
    assert not (tmp_path / "x.png").exists()


def test_draw_layout_tp_shapes_follow_the_planner_presets() -> None:
    """--tp's shapes are each TP rank's torch.chunk pieces under the Llama plan, and the picture's
    table of split dims agrees with the plan by module name the planner applies to its presets."""
    from tests.models.shapes import model_tp_dims
    from tools.plan_memory import PRESETS
    from tools.tp_plan import tp_dim

    for picture, preset in (("Llama-3-8B", "llama3-8b"), ("Mixtral-8x7B", "mixtral-8x7b")):
        with torch.device("meta"):
            named = list(PRESETS[preset]().named_parameters())
        assert [tuple(p.shape) for _, p in named] == model_shapes(picture)
        assert [tp_dim(fqn) for fqn, _ in named] == model_tp_dims(picture)
    full = model_shapes("Llama-3-8B")
    half = tp_shapes("Llama-3-8B", 2, 1)
    assert half[0] == (128256 // 2, 4096) and half[-1] == (128256 // 2, 4096)  # embedding, head: vocab
    assert half[1:5] == [(2048, 4096), (512, 4096), (512, 4096), (4096, 2048)]  # q, k, v col; o row
    assert half[5:8] == [(7168, 4096), (7168, 4096), (4096, 7168)] and half[8:10] == full[8:10]  # norms
    odd = tp_shapes("Mixtral-8x7B", 3, 2)
    assert odd[0] == (32000 - 2 * 10667, 4096) and odd[5] == (8, 4096)  # uneven vocab; router replicated
    assert len(tp_shapes("Mixtral-8x7B-stacked", 2)) == len(model_shapes("Mixtral-8x7B-stacked"))
    with pytest.raises(ValueError, match="tp-rank"):
        tp_shapes("Llama-3-8B", 2, 2)
    with pytest.raises(SystemExit):  # argparse: --tp must divide --world
        draw_main(["--model", "Llama-3-8B", "--world", "12", "--tp", "8"])


# ---------------------------------------------------------------- import direction


def _imports_tools(path: Path) -> list[str]:
    """``path``'s import statements that name the ``tools`` package, as ``line: module``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        found += [f"{node.lineno}: {n}" for n in names if n == "tools" or n.startswith("tools.")]
    return found


def test_only_the_tools_tests_import_tools() -> None:
    """The library, its tests and the shared models (tests/models) never import from tools/:
    the tools depend on them, not the other way round (tests/tools/ tests the tools)."""
    files = [f for d in ("dbuffer", "fsdp", "tests") for f in sorted((ROOT / d).rglob("*.py"))
             if (ROOT / "tests" / "tools") not in f.parents]
    assert any(f.parent.name == "models" for f in files)  # the scan reaches tests/models
    offenders = {str(f.relative_to(ROOT)): hits for f in files if (hits := _imports_tools(f))}
    assert offenders == {}
