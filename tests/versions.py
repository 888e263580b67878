"""What the tests of a feature check on a torch that lacks the API the feature is built on (the
differences themselves live in ``dbuffer/compat.py``).

``@pytest.mark.dp_mesh_dims`` marks a test of ``fully_shard``'s ``dp_mesh_dims``: on torch 2.12+
it runs as written; on 2.11, which has no ``DataParallelMeshDims``, ``tests/conftest.py`` runs
:func:`check_dp_mesh_dims_refused` in its place: every way in raises the clear error naming the
torch needed, before any process group is touched.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from dbuffer import compat
from dbuffer.torch_version import TorchVersionError

__all__ = ["check_dp_mesh_dims_refused", "fsdp2_flattens_shard_dims", "has_dp_mesh_dims"]


def has_dp_mesh_dims() -> bool:
    """Whether this torch has FSDP2's ``DataParallelMeshDims`` (2.12+)."""
    import torch.distributed.fsdp as torch_fsdp

    return hasattr(torch_fsdp, "DataParallelMeshDims")


def fsdp2_flattens_shard_dims() -> bool:
    """Whether torch's FSDP2 puts a parameter sharded over several ``dp_mesh_dims`` shard dims on
    the flattened mesh with ``Shard(0)`` (2.13+, what fsdp does on every torch) rather than on
    the full mesh with ``Shard(0)`` on each of those dims (2.12). By version: FSDP2's behaviour
    has no name to look for."""
    from dbuffer.torch_version import parse

    return parse(torch.__version__) >= (2, 13)


def check_dp_mesh_dims_refused() -> None:
    """On a torch without ``DataParallelMeshDims``: ``fsdp.DataParallelMeshDims(...)`` and
    ``fully_shard(..., dp_mesh_dims=...)`` raise ``TorchVersionError`` naming torch 2.12 and the
    torch found, and say what to pass instead."""
    import fsdp

    assert fsdp.DataParallelMeshDims is compat.data_parallel_mesh_dims()
    needed = rf"needs torch 2\.12 or newer; this is torch {torch.__version__.replace('+', '[+]')}"
    with pytest.raises(TorchVersionError, match=needed) as info:
        fsdp.DataParallelMeshDims(shard="dp_shard", replicate="dp_replicate")
    assert "mesh=full_mesh['dp_shard']" in str(info.value)
    with pytest.raises(TorchVersionError, match=needed):
        fsdp.fully_shard(nn.Linear(4, 4), dp_mesh_dims=object())
