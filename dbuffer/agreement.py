"""Check once, where it is cheap, that every rank of a mesh describes the same thing.

A DBuffer whose shapes differ between ranks makes gloo abort inside an all-gather ("Received
data size doesn't match expected size") on one rank and return garbage on another; a model
initialised with a different seed per rank becomes a silent mixture of each rank's rows. Both
are decided before any buffer exists, so :func:`check_agreement` runs there: every rank passes
a list of ``(name, description)`` entries (shapes, dtypes, placements, a hash of the values),
the ranks exchange one 64-bit digest of it, and only if some digest differs do they exchange
the entries themselves, so that **every rank raises the same** :class:`RankMismatchError`
naming the first differing entry and the ranks. Nothing hangs and nothing crashes: the
exchange has the same size on every rank whatever the entries are.

Cost when the ranks agree: one all-gather of one int64 per mesh axis. Skipped on torch's fake
process group (its collectives return no real data). Values are not compared on torch's threaded
test group (:func:`values_comparable`): its ranks are threads of one process drawing from one
shared random generator, so a model each thread builds differs by construction (FSDP2's own
multi-thread tests do that), while real ranks with the same seed build the same values.
"""

from __future__ import annotations

import hashlib
import pickle
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from dbuffer import collectives

__all__ = ["RankMismatchError", "check_agreement", "value_digest", "values_comparable"]

Entry = tuple[str, str]


class RankMismatchError(ValueError):
    """Ranks that must agree (same model, same buffers) do not; raised on every rank alike."""


def check_agreement(mesh: DeviceMesh, entries: Sequence[Entry], what: str, fix: str) -> None:
    """Raise :class:`RankMismatchError` on every rank of ``mesh`` unless all pass equal
    ``entries``. ``what`` names the thing checked, ``fix`` says what to change."""
    if _is_fake(mesh):
        return
    entries = [(str(name), str(desc)) for name, desc in entries]
    digest = int.from_bytes(hashlib.blake2b(pickle.dumps(entries), digest_size=8).digest(), "little", signed=True)
    digests = _gather_mesh(mesh, torch.tensor([digest], dtype=torch.int64, device="cpu"))
    if bool((digests == digests[0]).all()):
        return
    payload = pickle.dumps(entries)
    sizes = _gather_mesh(mesh, torch.tensor([len(payload)], dtype=torch.int64, device="cpu"))
    padded = torch.zeros(int(sizes.max()), dtype=torch.uint8, device="cpu")
    padded[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    every = _gather_mesh(mesh, padded).view(len(sizes), -1)
    lists = [pickle.loads(every[k, : int(sizes[k])].numpy().tobytes()) for k in range(len(sizes))]
    ranks = mesh.mesh.flatten().tolist()
    odd = [ranks[k] for k in range(len(lists)) if lists[k] != lists[0]]
    first = next(k for k in range(len(lists)) if lists[k] != lists[0])
    raise RankMismatchError(
        f"{what}: ranks disagree; {_first_difference(lists[0], lists[first], ranks[0], ranks[first])} "
        f"(ranks that differ from rank {ranks[0]}: {odd}). {fix}"
    )


def value_digest(t: torch.Tensor) -> str:
    """A short fingerprint of ``t``'s values (xor of their bit patterns): equal values give
    equal digests; differently initialised tensors differ with overwhelming probability (values
    that only trade places are not told apart). One pass over ``t``, no copy of it."""
    if t.device.type == "meta" or t.numel() == 0:
        return "-"  # no values yet
    t = t.detach()
    if type(t) is not torch.Tensor:  # a tensor subclass (float8, NF4): the tensors it holds
        if not hasattr(t, "__tensor_flatten__") or isinstance(t, DTensor):
            return "-"
        names, _ = t.__tensor_flatten__()
        return "/".join(value_digest(getattr(t, name)) for name in names)
    t = t.contiguous()
    bits = t.view(_BITS[t.element_size()])  # any dtype, float8 included
    xor = int(torch.hash_tensor(bits).view(torch.int64)) & (2**64 - 1)
    # xor cancels equal values in pairs (ones and twos of even count both give 0); a sum of the
    # bit patterns does not, and integer sums do not depend on the order of the reduction
    total = int(bits.sum(dtype=torch.int64)) & (2**64 - 1)
    return f"{xor:016x}{total:016x}"


_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _first_difference(a: list[Entry], b: list[Entry], rank_a: int, rank_b: int) -> str:
    """The first position where the two lists differ, said as an entry one rank lacks or
    describes otherwise."""
    da, db = dict(a), dict(b)
    for (name_a, desc_a), (name_b, desc_b) in zip(a, b):
        if name_a == name_b and desc_a != desc_b:
            return f"{name_a!r} is {desc_a} on rank {rank_a} but {desc_b} on rank {rank_b}"
        if name_a != name_b:
            if name_b not in da:
                return f"{name_b!r} is {desc_b} on rank {rank_b} but missing on rank {rank_a}"
            return f"{name_a!r} is {desc_a} on rank {rank_a} but missing on rank {rank_b}"
    longer, other, rank, rank_other = (a, db, rank_a, rank_b) if len(a) > len(b) else (b, da, rank_b, rank_a)
    name, desc = longer[min(len(a), len(b))]
    return f"{name!r} is {desc} on rank {rank} but missing on rank {rank_other}"


def _gather_mesh(mesh: DeviceMesh, t: torch.Tensor) -> torch.Tensor:
    """``t`` (same size on every rank) from every rank of ``mesh``, in mesh order: one all-gather
    per axis, innermost first."""
    device = collectives.mesh_device(mesh)
    current = t.to(device).reshape(-1)
    for axis in reversed(range(mesh.ndim)):
        group = mesh.get_group(axis)
        out = current.new_empty(current.numel() * mesh.shape[axis])
        collectives.all_gather(out, current, group)
        current = out
    return current.cpu()


def _is_fake(mesh: DeviceMesh) -> bool:
    return dist.get_backend(mesh.get_group(0)) == "fake"


def values_comparable(mesh: DeviceMesh) -> bool:
    """Whether ranks on ``mesh`` are expected to build equal values from equal seeds: not on the
    threaded test group, whose ranks share one random generator (see the module docstring)."""
    return dist.get_backend(mesh.get_group(0)) not in ("fake", "threaded")
