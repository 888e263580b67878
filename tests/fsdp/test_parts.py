"""The part Protocols (fsdp/group/parts.py) hold for every implementation: each class a group
is given as a part has every member its Protocol names, and a real group has every member the
builders of its parts and plan read (``GroupWithGrads``, ``ConfiguredGroup``), so the Protocols
stay true as code moves; no part (weights, gradient reducer, unsharder) sees its group, only
what it is built from.
The same for the Protocols that name an object without importing its class: a unit as the
tree's code reads it (``fsdp.unit.root.Unit``), the device's streams and events, FSDP2's comm
objects and a gradient hook's target."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

import fsdp
from fsdp.compose.custom_comm import CustomComms, MemoryAllGather, MemoryReduceScatter
from fsdp.compose.extensions import SubclassWeights
from fsdp.compose.post_forward import PostForwardShard
from fsdp.group.configure import ConfiguredGroup
from fsdp.group.grad_parts import GroupWithGrads
from fsdp.group import parts
from fsdp.group.comms import AllGatherComm, DBufferComms, ReduceScatterComm
from fsdp.group.shared_gather import SharedGather
from fsdp.group.streams import DeviceEvent, DeviceStream
from fsdp.group.weights import BufferWeights
from fsdp.unit.root import Unit
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


def methods(protocol: type) -> set[str]:
    """The methods a Protocol declares itself, private ones and ``__call__`` included."""
    return {n for n, v in vars(protocol).items() if inspect.isfunction(v) and (not n.startswith("__") or n == "__call__")}


def _group_members() -> dict:
    m = fsdp.fully_shard(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
    group, unit = m._fsdp_state.groups[0], m._fsdp_state
    missing = {p.__name__: sorted(n for n in members(p) if not hasattr(group, n))
               for p in (ConfiguredGroup, GroupWithGrads)}
    missing["Unit"] = sorted(n for n in members(Unit) | methods(Unit) if not hasattr(unit, n))
    return missing


def test_a_group_has_what_its_parts_may_read() -> None:
    (missing,) = run_ranks(_group_members, 1, backend="threaded")
    assert missing == {"ConfiguredGroup": [], "GroupWithGrads": [], "Unit": []}
    assert {"main", "weights", "names"} <= members(GroupWithGrads) and {"reduction", "comms"} <= members(ConfiguredGroup)
    assert {"groups", "root", "root_ctx", "_enter", "_final_callback"} <= members(Unit) | methods(Unit)


OBJECTS = [
    (DeviceStream, torch.cpu.Stream),
    (DeviceStream, torch.cuda.Stream),
    (DeviceEvent, torch.cpu.Event),
    (DeviceEvent, torch.cuda.Event),
    (DeviceEvent, torch.Event),
    (AllGatherComm, DefaultAllGather),
    (AllGatherComm, MemoryAllGather),
    (ReduceScatterComm, DefaultReduceScatter),
    (ReduceScatterComm, MemoryReduceScatter),
]


@pytest.mark.parametrize("protocol,impl", OBJECTS, ids=[f"{p.__name__}-{i.__module__}.{i.__qualname__}" for p, i in OBJECTS])
def test_what_a_protocol_names_without_importing_has_its_methods(protocol, impl) -> None:
    wanted = methods(protocol)
    assert wanted, protocol
    missing = {n for n in wanted if not callable(getattr(impl, n, None))}
    assert not missing, f"{impl.__qualname__} lacks {sorted(missing)} of {protocol.__name__}"


def _references_to_the_group() -> dict[str, list[str]]:
    from dataclasses import fields, is_dataclass

    m = fsdp.fully_shard(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
    group = m._fsdp_state.groups[0]

    def is_group(v: object) -> bool:
        return v is group or getattr(v, "__self__", None) is group  # the group or its bound method

    def refs(obj: object, name: str) -> list[str]:
        found = [f"{name}.{k}" for k, v in vars(obj).items() if is_group(v)]
        for k, v in vars(obj).items():
            if is_dataclass(v) and not isinstance(v, type):
                found += [f"{name}.{k}.{f.name}" for f in fields(v) if is_group(getattr(v, f.name))]
        return found

    weights = group.weights
    hooked = [h for p in weights.unsharded_params for h in p._post_accumulate_grad_hooks.values()]
    return {"grads": refs(group.grads, "grads") + refs(group.grads.parts.buffers, "buffers"),
            "unsharder": refs(group.unsharder, "unsharder") + refs(group.unsharder.unsharded, "unsharded"),
            "weights": refs(weights, "weights") + refs(weights.parts, "parts") + refs(weights.siblings, "siblings")
            + refs(weights.hooks, "hooks"),
            "hooked": len(hooked) == len(weights.unsharded_params)}


def test_no_part_holds_a_reference_to_its_group() -> None:
    """Composition downward: the weights part, the gradient reducer and the unsharder are built
    from what their group hands them (WeightsParts, Siblings, fsdp.group.grad_parts), never the
    group itself or one of its methods; the weights part hooks the parameters it makes."""
    (seen,) = run_ranks(_references_to_the_group, 1, backend="threaded")
    assert seen == {"grads": [], "unsharder": [], "weights": [], "hooked": True}
