"""Real text with no download: the Python standard library's own ``.py`` sources, as bytes.

    from tools.text_data import ByteText

    data = ByteText()                                   # ~4 MiB of text, loads in well under 1 s
    tokens = data.batch(step, batch_size=32, seq_len=128, rank=rank, world_size=world)
    logits = model(tokens[:, :-1]); loss = loss_fn(logits, tokens)

Tokens are bytes (``vocab_size = 256``), so any model with a vocabulary of at least 256 can
train on them. Files are read from the directory of the ``os`` module (skipping
``site-packages``, ``dist-packages`` and ``__pycache__``), walked in sorted order and concatenated
until ``max_bytes``: the same Python installation always gives the same text.

Batches are deterministic and independent of the world size. The *global* batch of a step is
``batch_size`` windows of ``seq_len + 1`` bytes whose start positions are drawn from a generator
seeded by ``(seed, step)`` only; rank ``r`` of ``world_size`` gets rows
``[r * batch_size // world_size, (r + 1) * batch_size // world_size)`` of it. Concatenating the
ranks' batches gives the single-process batch, so data-parallel training on it can be compared
with single-process training on the global batch.
"""

from __future__ import annotations

import hashlib
import os

import torch

__all__ = ["ByteText", "stdlib_sources"]

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_sources(max_bytes: int) -> bytes:
    """Up to ``max_bytes`` of the standard library's ``.py`` files, in sorted walk order."""
    root = os.path.dirname(os.__file__)
    chunks: list[bytes] = []
    total = 0
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in _SKIP_DIRS)
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            with open(os.path.join(directory, name), "rb") as f:
                chunk = f.read(max_bytes - total)
            chunks.append(chunk)
            total += len(chunk)
            if total >= max_bytes:
                return b"".join(chunks)
    return b"".join(chunks)


class ByteText:
    """Byte-level tokens of the standard library's sources with a world-size-independent sampler."""

    vocab_size = 256

    def __init__(self, max_bytes: int = 4 * 2**20, seed: int = 0) -> None:
        if not isinstance(max_bytes, int) or max_bytes < 2:
            raise ValueError(f"max_bytes must be an int >= 2, got {max_bytes!r}")
        if not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self.seed = seed
        raw = stdlib_sources(max_bytes)
        if len(raw) < 2:
            raise RuntimeError(f"found no standard-library .py sources under {os.path.dirname(os.__file__)}")
        self.data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)  # owns a private copy

    def __len__(self) -> int:
        return self.data.numel()

    def batch(self, step: int, batch_size: int, seq_len: int, rank: int = 0, world_size: int = 1) -> torch.Tensor:
        """Rank ``rank``'s rows of step ``step``'s global batch: ``LongTensor[batch_size // world_size, seq_len + 1]``.

        Row ``i`` of the global batch is ``data[s_i : s_i + seq_len + 1]`` for a start ``s_i``
        drawn uniformly from a generator seeded by ``(seed, step)``.
        """
        for name, value in (("step", step), ("batch_size", batch_size), ("seq_len", seq_len),
                            ("rank", rank), ("world_size", world_size)):
            if not isinstance(value, int):
                raise ValueError(f"{name} must be an int, got {value!r}")
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"need world_size >= 1 and 0 <= rank < world_size, got rank={rank}, world_size={world_size}"
            )
        if batch_size < 1 or batch_size % world_size:
            raise ValueError(
                f"batch_size={batch_size} must be a positive multiple of world_size={world_size} "
                "(it is the global batch, split evenly over ranks)"
            )
        if seq_len < 1 or seq_len + 1 > len(self):
            raise ValueError(f"seq_len must be in [1, {len(self) - 1}] for {len(self)} bytes of text, got {seq_len}")
        gen = torch.Generator().manual_seed(self._step_seed(step))
        starts = torch.randint(0, len(self) - seq_len, (batch_size,), generator=gen)
        per_rank = batch_size // world_size
        mine = starts[rank * per_rank:(rank + 1) * per_rank]
        return self.data[mine[:, None] + torch.arange(seq_len + 1)].long()

    def decode(self, tokens: torch.Tensor) -> str:
        """Text of a 1-D tensor of byte tokens (invalid UTF-8 is replaced)."""
        return bytes(tokens.tolist()).decode("utf-8", errors="replace")

    def _step_seed(self, step: int) -> int:
        digest = hashlib.blake2b(f"ByteText:{self.seed}:{step}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") >> 1  # a non-negative 63-bit seed
