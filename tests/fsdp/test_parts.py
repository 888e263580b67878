"""The part Protocols (fsdp/group/parts.py) hold for every implementation: each class a group
is given as a part has every member its Protocol names, and a real group has every member its
parts may read (``WeightsGroup``, ``ReducerGroup``), so the Protocols stay true as code moves."""

from __future__ import annotations

import inspect

import pytest
import torch.nn as nn

import fsdp
from fsdp.compose.custom_comm import CustomComms
from fsdp.compose.extensions import SubclassWeights
from fsdp.compose.post_forward import PostForwardShard
from fsdp.group import parts
from fsdp.group.comms import DBufferComms
from fsdp.group.shared_gather import SharedGather
from fsdp.group.weights import BufferWeights
from tests.harness import run_ranks


def members(protocol: type) -> set[str]:
    """The names a Protocol declares (annotations and methods), its Protocol bases' included."""
    names: set[str] = set()
    for cls in protocol.__mro__:
        if cls is object or not getattr(cls, "_is_protocol", False) or cls.__module__ == "typing":
            continue
        names |= set(cls.__dict__.get("__annotations__", {}))
        names |= {n for n, v in cls.__dict__.items() if not n.startswith("_") and (inspect.isfunction(v) or isinstance(v, property))}
    return names


IMPLEMENTATIONS = [
    (parts.Weights, BufferWeights),
    (parts.Weights, SubclassWeights),
    (parts.Comms, DBufferComms),
    (parts.Comms, CustomComms),
    (parts.PostForwardSlice, PostForwardShard),
    (parts.SharedGatherPart, SharedGather),
]


@pytest.mark.parametrize("protocol,impl", IMPLEMENTATIONS, ids=lambda x: x.__name__)
def test_every_part_has_what_its_protocol_names(protocol, impl) -> None:
    wanted = members(protocol)
    assert wanted, protocol
    source = inspect.getsource(impl)  # attributes set in __init__ count too
    missing = {n for n in wanted if not hasattr(impl, n) and f"self.{n}" not in source}
    assert not missing, f"{impl.__name__} lacks {sorted(missing)} of {protocol.__name__}"


def _group_members() -> dict:
    m = fsdp.fully_shard(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
    group = m._fsdp_state.groups[0]
    return {p.__name__: sorted(n for n in members(p) if not hasattr(group, n))
            for p in (parts.WeightsGroup, parts.ReducerGroup)}


def test_a_group_has_what_its_parts_may_read() -> None:
    (missing,) = run_ranks(_group_members, 1, backend="threaded")
    assert missing == {"WeightsGroup": [], "ReducerGroup": []}
    assert {"streams", "reduction", "reduce_into", "names", "main"} <= members(parts.ReducerGroup)
