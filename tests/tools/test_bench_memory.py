"""tools/bench_memory.py: what a rank holds with each framework's default dtypes, from the dtypes alone."""

import torch

from tests.models.llama import LlamaConfig
from tools.bench_memory import main, measure


def test_a_bf16_built_model_holds_fp32_main_weights_and_adamw_state_under_fsdp_only() -> None:
    """At a step's start FSDP2 holds bf16 weights and two bf16 AdamW moments (2 + 4 bytes per
    element of the shard); fsdp holds FP32 main weights, FP32 moments and the FP32 main grads it
    frees at the next forward (4 + 8 + 4). Layouts pad a little, so within 5%."""
    cfg = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_seq_len=8)
    r = measure(cfg, torch.bfloat16, world=4, batch=1)
    assert set(r) == {"ours", "fsdp2", "floor"}
    ratio = r["ours"]["start"] / r["fsdp2"]["start"]
    assert abs(ratio - 16 / 6) < 0.05 * 16 / 6, r
    assert r["ours"]["peak"] < r["floor"]["peak"] and r["fsdp2"]["peak"] < r["floor"]["peak"], r


def test_the_command_prints_both_ratios(capsys) -> None:
    assert main(["--built", "fp64", "--world", "2", "--layers", "1", "--dim", "16", "--hidden", "32",
                 "--vocab", "32", "--seq", "8", "--batch", "1"]) == 0
    out = capsys.readouterr().out
    assert "ours/FSDP2: held" in out and "fake world 2" in out
