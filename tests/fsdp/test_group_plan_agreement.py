"""fsdp/group/plan.py agrees with the groups ``fully_shard`` builds today.

Threaded ranks (world 4: a 1-D mesh of 4, a 2 x 2 HSDP / HFSDP mesh). For every strategy x mesh x
residence ``fully_shard`` takes, with the dtype policy, layout, comms, ``reshard_after_forward``
and the unit's setters rotated over them (and the combinations only some take), a model with a
frozen and a trained group (an embedding last: a forward-only tail) runs two micro-batches,
a refresh, and a gather of each group on its own. The plan of ``config_of(group)`` (fsdp/group/configure.py) is then
compared with what the current code *holds and does*, observed from outside the planner: the
buffers' objects, aliases, dtypes, placements, pinned host memory (CPU offload through the
device stand-in's transfers) and storage at fixed points, and the calls the group makes (casts,
gathers and what they read and fill, uploads, reductions and their targets, folds at launch),
recorded by wrapping them on the group's own objects. Every route, buffer and lifetime plain
parameters can take must have been compared.
"""

from __future__ import annotations

import contextlib
import copy
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

import fsdp
from dbuffer import Owned
from fsdp.group import plan as P
from fsdp.group.configure import config_of
from fsdp.group.plan import Buf, Lifetime, Place, Where, plan_group
from fsdp.group.policy import STRATEGIES, MixedPrecisionPolicy
from fsdp.group.unsharded_state import Unsharded
from tests.harness import run_ranks
from tests.models.device_standins import deferred_transfers

F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64
VOCAB, DIM, WORLD = 16, 8, 4


class Net(nn.Module):
    """A frozen linear (a group of its own), then a trained linear and an embedding (the trained
    group, its forward-only tail last)."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(DIM, DIM)
        self.lin = nn.Linear(DIM, DIM)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.frozen.requires_grad_(False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lin(self.frozen(self.embed(tokens)))


POLICIES = {  # (dtype the model is built in, its policy)
    "fp32": (F32, MixedPrecisionPolicy()),
    "bf16 param, fp32 main, bf16 reduce": (F32, MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=BF16)),
    "bf16 param, fp32 reduce": (F32, MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=F32)),
    "float64": (F64, MixedPrecisionPolicy()),
    "bf16 model, fp32 main": (BF16, MixedPrecisionPolicy()),
    "bf16 param, lean shard": (F32, MixedPrecisionPolicy(param_dtype=BF16, persistent_param_shard=False)),
    "bf16 main grads": (F32, MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=BF16, main_grads_dtype=BF16)),
}


@dataclass(frozen=True)
class Case:
    strategy: str
    mesh: str = "fsdp"  # fsdp | hsdp | hfsdp
    residence: str = "device"  # device | host | optim_state
    layout: str = "chunk"  # chunk | row | ragged | owned
    policy: str = "fp32"
    comms: str = "dbuffer"  # dbuffer | custom
    reshard: object = None  # reshard_after_forward: None (the root keeps), True, 2
    defer: bool = False  # set_requires_all_reduce(False)
    keep: bool = False  # set_keep_unsharded_storage(True)


def _cases() -> list[Case]:
    """Every strategy x mesh x residence fully_shard takes, the other options rotated over them
    with different periods; then the options only some combinations take."""
    cases, i = [], 0
    for strategy in STRATEGIES:
        for mesh in ("fsdp", "hsdp", "hfsdp"):
            for residence in ("device", "host", "optim_state"):
                if mesh == "hfsdp" and (strategy == "no_shard" or residence != "device"):
                    continue
                reshard = (None, True, 2 if mesh == "fsdp" else True)[i % 3]
                cases.append(Case(
                    strategy, mesh, residence, layout=("chunk", "row", "ragged", "chunk")[i % 4],
                    policy=list(POLICIES)[i % len(POLICIES)], comms="custom" if i % 5 == 4 and mesh != "hfsdp" else "dbuffer",
                    reshard=reshard, defer=mesh != "fsdp" and strategy in ("optim_grads", "optim_grads_params") and i % 2 == 1,
                ))
                i += 1
    z3 = "optim_grads_params"
    cases += [
        Case(z3, layout="owned"), Case(z3, layout="owned", policy="bf16 param, fp32 main, bf16 reduce", reshard=True),
        Case(z3, layout="owned", reshard=2),  # an Owned() group keeps no slice: reshards fully
        Case("optim_grads", layout="owned", policy="bf16 param, lean shard"),
        Case(z3, policy="bf16 param, lean shard", reshard=True), Case(z3, layout="row", policy="bf16 param, lean shard"),
        Case(z3, keep=True, reshard=True, policy="bf16 param, fp32 reduce"), Case(z3, keep=True, layout="row"),
        Case(z3, mesh="hsdp", comms="custom", policy="bf16 param, fp32 reduce", reshard=True),
        Case(z3, mesh="hfsdp", defer=True, policy="bf16 param, fp32 main, bf16 reduce"),
        Case(z3, residence="host", policy="bf16 param, fp32 main, bf16 reduce", reshard=True),
        Case(z3, residence="host", policy="bf16 param, lean shard", reshard=True),  # freed after its upload settled
        Case(z3, residence="host", policy="bf16 param, lean shard", layout="row"),
        Case(z3, reshard=2, policy="bf16 main grads", layout="ragged"),
        Case("optim_grads", mesh="hfsdp", layout="ragged", reshard=True),
    ]
    return cases


def _place(p) -> Place:
    if isinstance(p, Owned):
        return Place.OWNED
    return Place.PARTIAL if p.is_partial() else Place.SHARD if p.is_shard() else Place.REPLICATE


def _places(placements) -> tuple:
    return tuple(_place(p) for p in placements)


class Spy:
    """What one group holds and does, observed: its calls are recorded by wrapping them on the
    group's own objects (phase by phase), its storage looked at between phases."""

    def __init__(self, group) -> None:
        self.g, self.phase, self.calls, self.storage = group, "build", defaultdict(list), defaultdict(list)
        g, w = group, group.weights
        self._wrap(g.main, "cast", lambda dtype, out=None: ("cast", self.name(out)))
        for source in (g.main, w.cast_main):  # HFSDP's refresh gathers main, or its cast, over the replicas
            if source is not None:
                self._wrap(source, "redistribute", lambda placements, out=None, async_op=False: ("redistribute", self.name(out)))
        u = group.unsharder
        self._wrap(u, "_free_unsharded", lambda: self.look("reshard", only=(Buf.UNSHARDED,)))
        self._wrap(u, "_all_gather", lambda source, target: ("gather", self.name(source), self.name(target)))
        self._wrap(u, "join_gather", lambda *a: ("join",))
        self._wrap(w, "begin_gather", lambda kind=None: ("begin", kind))
        self._wrap(w, "gather_source", lambda: None, after=lambda out: ("source", self.last_kind, self.name(out)))
        self._wrap(w, "refresh", lambda model_current: None, during="model_refresh")
        if g.offload.on_host:
            self._wrap(g.offload, "upload", lambda src, out=None: ("upload", self.name(src), self.name(out)))
        if u.post_forward is not None:
            self._wrap(u.post_forward, "gather", lambda: ("slice_gather",))
        if g.grads is not None:
            r = g.grads
            self._wrap(r, "_reduce_into", lambda source, placements, out, async_op=True, kept=None: (
                "reduce", self.name(out), _places(out.placements), out.dtype), after=lambda pending: (
                "completed at launch", getattr(pending, "is_completed", lambda: None)()))
            self._wrap(r, "_allreduce_in_place", lambda: ("allreduce_in_place",))
            self._wrap(r, "launch_reduce", lambda: None, after=lambda _: (
                "launched", r._in_flight.folded if r._in_flight is not None else None))
        self.last_kind = None

    def _wrap(self, obj, attr, record, after=None, during=None) -> None:
        original = getattr(obj, attr)

        def wrapped(*args, **kwargs):
            entry = record(*args, **kwargs)
            if entry is not None:
                if entry[0] == "begin":
                    self.last_kind = entry[1]
                self.calls[self.phase].append(entry)
            before = self.phase
            if during is not None:
                self.phase = during
            try:
                out = original(*args, **kwargs)
            finally:
                self.phase = before
            if after is not None:
                self.calls[self.phase].append(after(out))
            return out

        setattr(obj, attr, wrapped)

    def name(self, buf) -> str:
        if buf is None:
            return "none"
        g, w = self.g, self.g.weights
        named = {"main": g.main, "model": w.model, "cast_main": w.cast_main, "unsharded": w.unsharded,
                 "gathered": w.gathered, "upload": getattr(g.offload, "_staging", None)}
        if g.grads is not None:
            named.update(grad_in=g.grads.grad_in, main_grad=g.grads.main_grad)
        for n, b in named.items():
            if b is buf:
                return n
        target = w.gathered_buffer()
        if buf.local_buffer.untyped_storage()._cdata == target.local_buffer.untyped_storage()._cdata:
            return "row"
        return "temp"

    def look(self, point: str, only: tuple = ()) -> None:
        """Which buffers (``only`` these, if given) have storage now."""
        g, w = self.g, self.g.weights
        bufs = {Buf.MAIN: g.main, Buf.MODEL: w.model, Buf.CAST_MAIN: w.cast_main, Buf.UNSHARDED: w.unsharded,
                Buf.GATHERED: w.gathered, Buf.UPLOAD: getattr(g.offload, "_staging", None)}
        if g.unsharder.post_forward is not None:
            bufs[Buf.SLICE] = g.unsharder.post_forward.buffer
        if g.grads is not None:
            bufs.update({Buf.GRAD_IN: g.grads.grad_in, Buf.MAIN_GRAD: g.grads.main_grad, Buf.PARTIAL: g.grads._partial})
        for name, b in bufs.items():
            if b is not None and (not only or name in only):
                self.storage[name].append((point, not b.is_storage_released()))

    def in_phases(self, *phases) -> list:
        return [c for p in phases for c in self.calls[p]]


def _observed_lifetime(spy: Spy, name: Buf) -> Lifetime:
    """The lifetime the storage seen at each point shows (build, after the first forward, after
    its backward, after the refresh, after the own gathers), by the enum's definition."""
    seen = dict(spy.storage[name])
    ever = any(seen.values())
    if name is Buf.MAIN_GRAD:
        return Lifetime.GRADIENTS if not seen["build"] and seen["backward"] else None
    if name is Buf.PARTIAL:
        return Lifetime.DEFERRED if seen.get("backward") else None
    if name is Buf.SLICE:
        return Lifetime.FORWARD_TO_BACKWARD if seen["forward"] and not seen["backward"] else None
    if not ever:  # only inside a gather or a reduction, or never: told apart by what was cast into it
        if name is Buf.GRAD_IN:
            return Lifetime.REDUCTION
        casts = name is not Buf.MODEL or ("cast", "model") in spy.in_phases(*spy.calls)
        return Lifetime.GATHER if casts else Lifetime.NEVER
    values = [has for _, has in spy.storage[name]]
    first = values.index(True)
    if all(values[first:]):  # from fully_shard, or from the first gather of a kept storage, on
        return Lifetime.RUN
    if name is Buf.UNSHARDED and seen.get("reshard") and not (seen["build"] or seen["backward"] or seen["refresh"] or seen["own"]):
        return Lifetime.GATHER_TO_RESHARD
    if name is Buf.MODEL and seen["build"] and not seen["forward"] and seen["refresh"]:
        return Lifetime.REFRESH_TO_FORWARD
    return None


def _observe_routes(spy: Spy, case: Case) -> dict:
    g, out = spy.g, {}
    refresh_calls = spy.in_phases("model_refresh")
    casts = {c[1] for c in refresh_calls if c[0] == "cast"}
    rebuilt = ("redistribute", "model") in refresh_calls
    out["model_refresh"] = (
        P.ModelRefresh.CAST_GATHER_REPLICAS if rebuilt and "cast_main" in casts else P.ModelRefresh.GATHER_REPLICAS
        if rebuilt else P.ModelRefresh.CAST if "model" in casts else P.ModelRefresh.NONE
    )
    uploads = [c for c in refresh_calls if c[0] == "upload" and c[2] == "unsharded"]
    gathered_at_refresh = any(c[0] == "gather" for c in spy.in_phases("refresh"))
    forward = spy.in_phases("forward", "forward2", "own")
    if gathered_at_refresh:
        out["unsharding"] = P.Unsharding.GATHER_AT_REFRESH
    elif uploads:
        out["unsharding"] = P.Unsharding.UPLOAD_AT_REFRESH
    elif any(c[0] in ("gather", "join") for c in forward):
        out["unsharding"] = P.Unsharding.GATHER_AT_UNSHARD
    elif g.weights.unsharded is g.weights.model:
        out["unsharding"] = P.Unsharding.IS_MODEL
    own = {(c[1], c[2]) for c in spy.in_phases("refresh", "own") if c[0] == "gather"}
    sources = {"row": P.GatherSource.OWN_ROW, "main": P.GatherSource.MAIN, "model": P.GatherSource.MODEL, "upload": P.GatherSource.HOST_UPLOAD}
    out["gather_source"] = {sources.get(s) for s, _ in own} if own else {P.GatherSource.NONE}
    out["gather_landing"] = {{"unsharded": P.GatherLanding.UNSHARDED, "gathered": P.GatherLanding.GATHERED}.get(t) for _, t in own} if own else {P.GatherLanding.NONE}
    joined = any(c[0] == "join" for c in spy.in_phases(*spy.calls))
    shared = {sources.get(c[2]) for c in spy.in_phases(*spy.calls) if c[0] == "source" and c[1] is not None and c[1].name == "SHARED"}
    out["joined"] = joined
    out["shared_source"] = shared if joined else {P.GatherSource.NONE}
    if case.reshard is None:
        out["kept_after_forward"] = P.KeptAfterForward.FREE_FORWARD_ONLY_TAIL if spy.tail_freed else P.KeptAfterForward.KEEP_ALL
        params = g.unsharded_params  # views of the unsharded buffer: is the last parameter last in it?
        out["tail last"] = all(p.storage_offset() + p.numel() <= params[-1].storage_offset() for p in params[:-1])
    else:
        state = spy.after_forward_state
        out["after_forward"] = {Unsharded.SLICE_KEPT: P.AfterForward.KEEP_SLICE, Unsharded.SHARDED: P.AfterForward.FREE}.get(state, P.AfterForward.KEEP)
        back = spy.in_phases("backward")
        out["backward_gather"] = (
            P.BackwardGather.FROM_SLICE if ("slice_gather",) in back else P.BackwardGather.FULL
            if any(c[0] in ("gather", "join") for c in back) else P.BackwardGather.NONE
        )
    for phase, key in (("backward", "overwrite"), ("backward2", "accumulate")):
        calls = spy.in_phases(phase)
        routes = set()
        for c in calls:
            if c[0] == "allreduce_in_place":
                routes.add(P.ReduceRoute.IN_PLACE)
            elif c[0] == "reduce" and c[1] == "main_grad":
                routes.add(P.ReduceRoute.DIRECT)
            elif c[0] == "reduce" and c[2] == _places(g.grads.main_grad.placements):
                routes.add(P.ReduceRoute.TEMPORARY)
            elif c[0] == "reduce" and c[2] == _places(g.placements.deferred):
                routes.add(P.ReduceRoute.DEFERRED)
        out[key] = routes or {P.ReduceRoute.NONE}
        if key == "overwrite":
            out["collective"] = {_collective(c) for c in calls if c[0] in ("reduce", "allreduce_in_place")} or {P.ReduceCollective.NONE}
        out[f"{key} folded at launch"] = {c[1] for c in calls if c[0] == "launched"}
        out[f"{key} completed at launch"] = {c[1] for c in calls if c[0] == "completed at launch"}
    out["temporaries"] = {(c[2], c[3]) for c in spy.in_phases(*spy.calls) if c[0] == "reduce" and c[1] == "temp"}
    return out


def _collective(call: tuple):
    """The collective a reduction made, by the placements it reduced ``Partial`` gradients to."""
    if call[0] == "allreduce_in_place":
        return P.ReduceCollective.ALL_REDUCE
    target, R = call[2], Place.REPLICATE
    if Place.PARTIAL in target:
        return P.ReduceCollective.SHARD_AXIS_ONLY
    if all(p is R for p in target):
        return P.ReduceCollective.ALL_REDUCE
    if len(target) == 1:
        return P.ReduceCollective.REDUCE_SCATTER
    return P.ReduceCollective.REDUCE_SCATTER_ALL_REDUCE if target[0] is R else P.ReduceCollective.REDUCE_SCATTER_TWICE


def _where(g, buf) -> Where:
    transfers = getattr(g.offload, "transfers", None)
    return Where.HOST if transfers is not None and transfers.is_pinned(buf.local_buffer) else Where.DEVICE


def _build(case: Case, model: nn.Module, meshes: dict):
    dtype, policy = POLICIES[case.policy]
    kw = dict(sharding_strategy=case.strategy, mp_policy=policy, reshard_after_forward=case.reshard)
    offload = {"host": fsdp.CPUOffloadPolicy(pin_memory=True), "optim_state": fsdp.OptimizerStateOffloadPolicy()}
    if case.residence in offload:
        kw["offload_policy"] = offload[case.residence]
    if case.mesh == "hfsdp":
        kw["outer_dp_sharding_strategy"] = "optim"
    if case.layout == "owned":
        kw["buckets"] = [fsdp.Bucket(["frozen.*", "lin.*", "embed.*"], placement=Owned())]
    layout = fsdp.layout_policy(case.layout) if case.layout in ("row", "ragged") else contextlib.nullcontext()
    with layout:
        m = fsdp.fully_shard(copy.deepcopy(model).to(dtype), mesh=meshes[case.mesh != "fsdp"], **kw)
    if case.comms == "custom":
        m.set_custom_all_gather(DefaultAllGather())
        m.set_custom_reduce_scatter(DefaultReduceScatter())
    if case.defer:
        m.set_requires_all_reduce(False)
    if case.keep:
        m.set_keep_unsharded_storage(True)
    return m


def _refresh(g) -> None:
    """As after an optimizer step."""
    g.unsharder.mark_stale()
    g.unsharder.refresh()


def _gather_alone(g) -> None:
    """A ZeRO-3 group's own gather (a unit's may be shared with its other groups)."""
    if g.strategy.shard_params:
        g.unsharder.reshard()
        g.unsharder.unshard()
        g.unsharder.reshard()


def _agree(cases: list[Case], model: nn.Module, tokens: torch.Tensor) -> list:
    """Per case and group: (case, group, what, planned, observed) for every disagreement, and the
    number of groups checked."""
    meshes = (init_device_mesh("cpu", (WORLD,)), init_device_mesh("cpu", (2, 2), mesh_dim_names=("r", "s")))
    wrong, checked, covered = [], 0, set()
    for case in cases:
        m = _build(case, model, meshes)
        groups = m._fsdp_state.groups
        slice_ranks = case.reshard if isinstance(case.reshard, int) and not isinstance(case.reshard, bool) else None
        plans = [plan_group(config_of(g, slice_ranks if case.mesh == "fsdp" else None)) for g in groups]
        spies = [Spy(g) for g in groups]
        for spy in spies:
            spy.look("build")

        def phase(name, fn):
            for spy in spies:
                spy.phase = name
            fn()

        def step(n):
            loss = []
            phase("forward" if n == 1 else "forward2", lambda: loss.append(m(tokens[dist.get_rank()]).float().pow(2).mean()))
            if n == 1:
                for spy in spies:
                    spy.look("forward")
                    spy.tail_freed = spy.g.unsharder.forward_only_freed()
                    spy.after_forward_state = spy.g.unsharder.unsharded.state
            phase("backward" if n == 1 else "backward2", lambda: loss[0].backward())
            if n == 1:
                for spy in spies:
                    spy.look("backward")

        step(1)
        step(2)
        grad_copies = {}
        for spy, g in zip(spies, groups):
            if g.grads is not None:
                attached = [p for p in g.sharded_params if p.grad is not None]
                grad_copies[id(g)] = (any(p.grad is not p.main_grad for p in attached), {p.grad.dtype for p in attached})

        for name, fn in (("refresh", _refresh), ("own", _gather_alone)):
            phase(name, lambda: [fn(g) for g in groups])
            for spy in spies:
                spy.look(name)
        all_share = len(groups) > 1 and all(p.sharing is P.Sharing.MAY_SHARE for p in plans)
        for g, plan, spy in zip(groups, plans, spies):
            checked += 1
            covered |= _values(plan)
            gname = "trained" if g.requires_grad else "frozen"

            def check(what, planned, observed):
                if planned != observed:
                    wrong.append((case, gname, what, planned, observed))

            c = plan.config
            check("config.strategy", c.strategy.name, case.strategy)
            check("config.mesh", c.mesh.name, case.mesh.upper())
            check("config.residence", c.residence.name, case.residence.upper())
            want_layout = "WHOLE" if case.strategy == "no_shard" else "ROW" if case.mesh == "hfsdp" and case.layout == "chunk" else case.layout.upper()
            check("config.layout", c.layout.name, want_layout)
            check("config.comms", c.comms.name, case.comms.upper())
            defers = case.defer and g.requires_grad and case.mesh != "fsdp"  # a 1-D mesh has no replicas: ignored
            check("config.replica_reduce", c.replica_reduce.name, "DEFERRED" if defers else "NOW")
            check("config.forward_only", c.forward_only.name, "TAIL" if g.requires_grad else "NONE")
            check("config.gather_scope", c.gather_scope.name, "OWN" if case.layout == "owned" else "UNIT")

            w = g.weights
            held = {Buf.MAIN: g.main, Buf.MODEL: w.model, Buf.CAST_MAIN: w.cast_main, Buf.UNSHARDED: w.unsharded,
                    Buf.GATHERED: w.gathered, Buf.UPLOAD: getattr(g.offload, "_staging", None),
                    Buf.SLICE: g.unsharder.post_forward.buffer if g.unsharder.post_forward is not None else None}
            if g.grads is not None:
                held.update({Buf.GRAD_IN: g.grads.grad_in, Buf.MAIN_GRAD: g.grads.main_grad})
            aliases = {Buf.MODEL: g.main, Buf.UNSHARDED: w.model}
            observed_names = {n for n, b in held.items() if b is not None}
            seen = _observe_routes(spy, case)
            temps = seen["temporaries"]
            if g.grads is not None:
                if any(pl == _places(g.grads.main_grad.placements) for pl, _ in temps):
                    observed_names.add(Buf.REDUCE_OUT)
                if spy.storage[Buf.PARTIAL]:  # deferred sums were kept
                    observed_names.add(Buf.PARTIAL)
                copies, dtypes = grad_copies[id(g)]
                if copies or (not dtypes and Buf.GRAD_COPY in plan.names()):  # nothing attached: not seen
                    observed_names.add(Buf.GRAD_COPY)
            check("buffers", sorted(b.name for b in plan.names()), sorted(b.name for b in observed_names))
            for b in plan.buffers:
                if b.name not in observed_names:
                    continue
                obj = held.get(b.name)
                if b.name in (Buf.REDUCE_OUT, Buf.PARTIAL):
                    pl = b.placements
                    check(f"{b.name.name} dtype", b.dtype, next(dt for p, dt in temps if p == pl))
                    continue
                if b.name is Buf.GRAD_COPY:
                    check("GRAD_COPY dtype", {b.dtype}, grad_copies[id(g)][1] or {b.dtype})
                    continue
                check(f"{b.name.name} alias", b.alias_of is not None, obj is aliases.get(b.name))
                check(f"{b.name.name} dtype", b.dtype, obj.dtype)
                check(f"{b.name.name} placements", b.placements, _places(obj.placements))
                check(f"{b.name.name} where", b.where, _where(g, obj))
                if b.alias_of is None:
                    if not (b.name is Buf.MAIN_GRAD and case.defer):  # a deferring backward leaves main_grad empty
                        check(f"{b.name.name} lifetime", b.lifetime, _observed_lifetime(spy, b.name))
            check("model_refresh", plan.model_refresh, seen["model_refresh"])
            check("unsharding", plan.unsharding, seen.get("unsharding"))
            check("gather_source", {plan.gather_source}, seen["gather_source"])
            check("gather_landing", {plan.gather_landing}, seen["gather_landing"])
            check("shared gather", plan.sharing is P.Sharing.MAY_SHARE and all_share, seen["joined"])
            check("shared_source", {plan.shared_source if seen["joined"] else P.GatherSource.NONE}, seen["shared_source"])
            if case.reshard is None:
                kept = plan.kept_after_forward
                if kept is P.KeptAfterForward.FREE_TAIL_IF_LAST:  # freed exactly where the tail lies last
                    free = P.KeptAfterForward.FREE_FORWARD_ONLY_TAIL
                    kept = free if seen["tail last"] else P.KeptAfterForward.KEEP_ALL
                check("kept_after_forward", kept, seen["kept_after_forward"])
            else:
                check("after_forward", plan.after_forward, seen["after_forward"])
                check("backward_gather", plan.backward_gather, seen["backward_gather"])
            r = plan.reduce
            check("reduce overwrite", {r.overwrite}, seen["overwrite"])
            check("reduce accumulate", {r.accumulate}, seen["accumulate"])
            check("reduce collective", {r.collective}, seen["collective"])
            for key, route in (("overwrite", r.overwrite), ("accumulate", r.accumulate)):
                folded = seen[f"{key} folded at launch"]
                if route is not P.ReduceRoute.TEMPORARY or r.fold is not P.FoldWhen.AT_LAUNCH_IF_FREE:
                    check(f"{key} folded at launch", set(), folded - {False, None})
                else:  # without real streams a wait is free exactly when the collective has completed
                    check(f"{key} folded at launch", seen[f"{key} completed at launch"], folded)
            if g.grads is not None:
                check("reduce into", r.into, _where(g, g.grads.main_grad))
            check("optim_state", plan.optim_state, Where.HOST if g.offload.on_host or g.offload.optim_state is not None else Where.DEVICE)
    return [wrong, checked, covered]


def _values(plan) -> set:
    """Every enum value a plan states (its routes, its buffers' names and lifetimes)."""
    r = plan.reduce
    found = {b.name for b in plan.buffers} | {b.lifetime for b in plan.buffers}
    return found | {
        plan.model_refresh, plan.unsharding, plan.gather_source, plan.gather_landing, plan.sharing, plan.shared_source,
        plan.after_forward, plan.kept_after_forward, plan.backward_gather, r.collective, r.overwrite, r.accumulate,
        r.fold, r.into,
    }


def test_plans_agree_with_the_groups_fully_shard_builds() -> None:
    cases = _cases()
    torch.manual_seed(0)
    model = Net()
    tokens = torch.randint(0, VOCAB, (WORLD, 2, 3))
    with deferred_transfers():  # host buffers "pinned" on the CPU: where a buffer lives shows
        results = run_ranks(_agree, WORLD, cases, model, tokens, backend="threaded", timeout=300)
    for wrong, checked, covered in results:
        assert checked == 2 * len(cases), checked  # a frozen and a trained group in every case
        # every route, buffer and lifetime plain parameters can take was compared with the code
        subclass_only = {P.ModelRefresh.PRE_ALL_GATHER, P.GatherSource.SEND, Buf.SEND}
        enums = (P.ModelRefresh, P.Unsharding, P.GatherSource, P.GatherLanding, P.Sharing, P.AfterForward,
                 P.KeptAfterForward, P.BackwardGather, P.ReduceCollective, P.ReduceRoute, P.FoldWhen, Buf, Lifetime, Where)
        assert {v for e in enums for v in e} - subclass_only - covered == set()
        assert not wrong, "\n".join(f"{case}: {group} {what}: planned {p}, observed {o}" for case, group, what, p, o in wrong[:40])
