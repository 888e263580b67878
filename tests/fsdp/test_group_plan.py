"""fsdp/group/plan.py: the planner's invariants over its whole configuration space.

The planner is pure, so hypothesis walks every strategy x residence x dtype policy (built by
the real ``MixedPrecisionPolicy.dtypes_for``) x mesh (FSDP, HSDP, HFSDP) x layout x parameter
kind x comms x the unit's setters, and checks what a plan must satisfy whatever the config: the
buffers its routes touch are planned, dtypes and placements follow the config, host offload puts
the main state on the host, ZeRO-3 frees what the others keep, frozen groups reduce nothing, and
each route is taken exactly where the code's condition for it holds. That the plan states what
the code does is ``test_group_plan_agreement.py``'s part.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from fsdp.group import plan as P
from fsdp.group.plan import Buf, GroupConfig, Lifetime, Place, Where, plan_group
from fsdp.group.policy import FLOAT32_OR_WIDER, STRATEGIES, MixedPrecisionPolicy
from tests.hypothesis_profiles import examples

F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64
MODEL_DTYPED = (Buf.MODEL, Buf.CAST_MAIN, Buf.UPLOAD, Buf.UNSHARDED, Buf.GATHERED, Buf.SLICE)
REDUCE_DTYPED = (Buf.GRAD_IN, Buf.REDUCE_OUT, Buf.PARTIAL)
GRAD_BUFFERS = {Buf.GRAD_IN, Buf.MAIN_GRAD, Buf.REDUCE_OUT, Buf.PARTIAL, Buf.GRAD_COPY}


@st.composite
def configs(draw) -> GroupConfig:
    """A configuration ``fully_shard`` accepts: drawn field by field, each within what the earlier
    ones allow (the few leftovers GroupConfig refuses are rejected)."""
    strategy = draw(st.sampled_from(sorted(STRATEGIES.values(), key=lambda s: s.name)))
    requires_grad = draw(st.booleans())
    policy = MixedPrecisionPolicy(
        param_dtype=draw(st.sampled_from([None, BF16, F32])),
        reduce_dtype=draw(st.sampled_from([None, BF16, F32])),
        main_params_dtype=draw(st.sampled_from([FLOAT32_OR_WIDER, None, BF16, F32])),
        main_grads_dtype=draw(st.sampled_from([None, BF16, F32])),
    )
    dtypes = policy.dtypes_for(draw(st.sampled_from([BF16, F32, F64])), requires_grad=requires_grad)
    mesh = draw(st.sampled_from(list(P.MeshKind)))
    params = draw(st.sampled_from(list(P.ParamsKind)) if mesh is not P.MeshKind.HFSDP else st.just(P.ParamsKind.PLAIN))
    residence = P.ResidenceKind.DEVICE
    if params is P.ParamsKind.PLAIN and mesh is not P.MeshKind.HFSDP:
        residence = draw(st.sampled_from(list(P.ResidenceKind)))
    if not strategy.shard_optim:
        layout = P.LayoutKind.WHOLE
    elif params is P.ParamsKind.SUBCLASS:
        layout = P.LayoutKind.CHUNK
    elif mesh is P.MeshKind.HFSDP:
        layout = draw(st.sampled_from([P.LayoutKind.ROW, P.LayoutKind.RAGGED]))
    else:
        flat = [P.LayoutKind.ROW, P.LayoutKind.RAGGED] + ([P.LayoutKind.OWNED] if mesh is P.MeshKind.FSDP else [])
        layout = draw(st.sampled_from([P.LayoutKind.CHUNK] + flat))
    config = dict(
        strategy=strategy, dtypes=dtypes, requires_grad=requires_grad, mesh=mesh, residence=residence,
        layout=layout, params=params, comms=draw(st.sampled_from(list(P.CommsKind))),
        model_shard=draw(st.sampled_from(list(P.ModelShard))), gather_scope=draw(st.sampled_from(list(P.GatherScope))),
        slice_ranks=draw(st.sampled_from([None, 2, 4])) if mesh is P.MeshKind.FSDP else None,
        forward_only=draw(st.sampled_from(list(P.ForwardOnly))),
        replica_reduce=draw(st.sampled_from(list(P.ReplicaReduce))) if requires_grad else P.ReplicaReduce.NOW,
        unsharded_storage=draw(st.sampled_from(list(P.UnshardedStorage))),
        grads_to=draw(st.sampled_from(list(P.GradsTo))) if requires_grad else P.GradsTo.REACHED,
    )
    try:
        return GroupConfig(**config)
    except ValueError:
        assume(False)
        raise


def _check_plan(c: GroupConfig) -> None:
    plan = plan_group(c)
    s, d = c.strategy, c.dtypes
    host, subclass = c.residence is P.ResidenceKind.HOST, c.params is P.ParamsKind.SUBCLASS
    assert plan == plan_group(c) and hash(plan) == hash(plan_group(c)), "pure and frozen"
    names = [b.name for b in plan.buffers]
    assert len(names) == len(set(names)), names
    assert plan.touched() <= plan.names(), f"routes touch unplanned buffers {plan.touched() - plan.names()}"
    buf = {b.name: b for b in plan.buffers}
    ndim = 1 if c.mesh is P.MeshKind.FSDP else 2

    for b in plan.buffers:
        if b.alias_of is not None:  # the same object: the same properties, and no alias of an alias
            target = buf[b.alias_of]
            assert target.alias_of is None and (b.placements, b.dtype, b.where) == (target.placements, target.dtype, target.where)
        assert len(b.placements) == (2 if b.name is Buf.SLICE else ndim), b
        assert (Place.OWNED in b.placements) <= (c.layout is P.LayoutKind.OWNED), b
        # dtypes follow the group's dtypes (None only for what a subclass's extension returns)
        want = {Buf.MAIN: d.main, Buf.MAIN_GRAD: d.main_grad, Buf.GRAD_COPY: d.main}.get(b.name)
        if b.name in MODEL_DTYPED:
            want = d.model
        if b.name in REDUCE_DTYPED:
            want = d.reduce
        assert b.dtype == want or (b.dtype is None and subclass and b.name in (Buf.UNSHARDED, Buf.GATHERED)), b
        assert (b.dtype is None) == (subclass and b.name in (Buf.UNSHARDED, Buf.GATHERED, Buf.SEND)), b
        # host offload: the main state on the host, every compute buffer on the device
        on_host = host and b.name in (Buf.MAIN, Buf.MODEL, Buf.MAIN_GRAD, Buf.GRAD_COPY)
        assert b.where is (Where.HOST if on_host else Where.DEVICE), b
        # a buffer no route reads or writes is never allocated, and the reverse
        if b.lifetime is Lifetime.NEVER:
            assert b.name not in plan.touched(), b
    assert (plan.optim_state is Where.HOST) == (c.residence is not P.ResidenceKind.DEVICE)

    # placements: what is sharded is the strategy's
    shard = Place.OWNED if c.layout is P.LayoutKind.OWNED else Place.SHARD
    assert buf[Buf.MAIN].placements[-1] is (shard if s.shard_optim else Place.REPLICATE)
    assert all(p is Place.REPLICATE for p in buf[Buf.UNSHARDED].placements)
    if c.mesh is P.MeshKind.HFSDP:
        assert buf[Buf.MAIN].placements == (Place.SHARD, Place.SHARD) and buf[Buf.MODEL].placements == (Place.SHARD, Place.REPLICATE)
    elif c.mesh is P.MeshKind.HSDP:
        assert buf[Buf.MAIN].placements[0] is Place.REPLICATE
    # the model shard
    if subclass:
        assert Buf.MODEL not in buf and Buf.SEND in buf and plan.model_refresh is P.ModelRefresh.PRE_ALL_GATHER
    else:
        alias = c.mesh is not P.MeshKind.HFSDP and d.model == d.main
        assert (buf[Buf.MODEL].alias_of is Buf.MAIN) == alias
        assert (Buf.CAST_MAIN in buf) == (c.mesh is P.MeshKind.HFSDP and d.model != d.main)
        if plan.model_refresh is P.ModelRefresh.CAST:
            assert not alias and buf[Buf.MODEL].lifetime is not Lifetime.NEVER
    # gathers: only of sharded weights; ZeRO-3 before each use, ZeRO-1/2 at the refresh
    gathers = plan.unsharding in (P.Unsharding.GATHER_AT_UNSHARD, P.Unsharding.GATHER_AT_REFRESH)
    assert gathers == s.shard_optim
    assert (plan.unsharding is P.Unsharding.GATHER_AT_UNSHARD) == s.shard_params
    assert (plan.unsharding is P.Unsharding.UPLOAD_AT_REFRESH) == (not s.shard_optim and host)
    assert (plan.gather_source is P.GatherSource.NONE) == (not gathers) == (plan.gather_landing is P.GatherLanding.NONE)
    if gathers:
        assert (plan.gather_landing is P.GatherLanding.GATHERED) == (c.layout is P.LayoutKind.CHUNK)
    assert (Buf.GATHERED in buf) == (c.layout is P.LayoutKind.CHUNK)
    assert (Buf.UPLOAD in buf) == (host and s.shard_optim) == (plan.gather_source is P.GatherSource.HOST_UPLOAD)
    # FSDP2's copy-in: main cast straight into the target's row exactly where that is possible
    into_row = (
        d.model != d.main and s.shard_optim and not host and not subclass
        and c.mesh is not P.MeshKind.HFSDP and c.layout is not P.LayoutKind.OWNED
    )
    assert (plan.gather_source is P.GatherSource.OWN_ROW) == into_row
    assert plan.shared_source is not P.GatherSource.OWN_ROW, "a shared gather reads a shard, never a row"
    if plan.sharing is P.Sharing.MAY_SHARE:
        assert s.shard_params and c.layout is P.LayoutKind.CHUNK and c.comms is P.CommsKind.DBUFFER
        assert c.gather_scope is P.GatherScope.UNIT and plan.shared_source is not P.GatherSource.NONE
    else:
        assert plan.shared_source is P.GatherSource.NONE
    if buf.get(Buf.MODEL) is not None and buf[Buf.MODEL].lifetime is Lifetime.GATHER:  # cast for each gather that reads it
        assert P.GatherSource.MODEL in (plan.gather_source, plan.shared_source) or plan.gather_source is P.GatherSource.HOST_UPLOAD
    # ZeRO-3 frees the unsharded weights after use (unless asked to keep the storage); others keep them
    life = buf[Buf.UNSHARDED].lifetime
    keep = c.unsharded_storage is P.UnshardedStorage.KEEP
    assert (life is Lifetime.GATHER_TO_RESHARD) == (s.shard_params and not keep)
    assert (plan.after_forward is P.AfterForward.KEEP) == (not s.shard_params) == (plan.backward_gather is P.BackwardGather.NONE)
    slice_kept = (  # an Owned() layout has no Shard(0) slice for n ranks: it reshards fully
        c.slice_ranks is not None and s.shard_params and c.mesh is P.MeshKind.FSDP and not host
        and c.params is P.ParamsKind.PLAIN and c.layout is not P.LayoutKind.OWNED
    )
    assert (Buf.SLICE in buf) == slice_kept == (plan.after_forward is P.AfterForward.KEEP_SLICE)
    assert (plan.backward_gather is P.BackwardGather.FROM_SLICE) == slice_kept
    if plan.kept_after_forward is not P.KeptAfterForward.KEEP_ALL:
        assert c.forward_only is P.ForwardOnly.TAIL and s.shard_params and c.params is P.ParamsKind.PLAIN and not keep
        assert (plan.kept_after_forward is P.KeptAfterForward.FREE_TAIL_IF_LAST) == (c.layout is P.LayoutKind.OWNED)

    # gradients
    r = plan.reduce
    if not c.requires_grad:
        assert not (GRAD_BUFFERS & plan.names()) and r.overwrite is r.accumulate is P.ReduceRoute.NONE
        assert r.collective is P.ReduceCollective.NONE
        return
    assert {Buf.GRAD_IN, Buf.MAIN_GRAD} <= plan.names() and all(p is Place.PARTIAL for p in buf[Buf.GRAD_IN].placements)
    assert buf[Buf.MAIN_GRAD].placements[-1] is (shard if s.shard_grads else Place.REPLICATE)
    assert (Buf.GRAD_COPY in buf) == (d.main_grad != d.main)
    deferred = ndim == 2 and s.shard_grads and c.replica_reduce is P.ReplicaReduce.DEFERRED
    assert (Buf.PARTIAL in buf) == deferred == (r.overwrite is P.ReduceRoute.DEFERRED) == (r.accumulate is P.ReduceRoute.DEFERRED)
    if not deferred:
        direct = d.reduce == d.main_grad and not host
        assert (r.overwrite is P.ReduceRoute.DIRECT) == direct and r.accumulate is not P.ReduceRoute.DIRECT
        assert r.accumulate is (P.ReduceRoute.TEMPORARY if s.shard_grads else P.ReduceRoute.IN_PLACE)
        assert (Buf.REDUCE_OUT in buf) == s.shard_grads
        assert (r.collective is P.ReduceCollective.ALL_REDUCE) == (not s.shard_grads)
        if r.fold is P.FoldWhen.AT_LAUNCH_IF_FREE:  # a fold at launch blocks no host and no custom staging
            assert not host and c.comms is P.CommsKind.DBUFFER
    assert (r.into is Where.HOST) == host
    assert r.grads_to is c.grads_to


@settings(max_examples=examples(400))
@given(c=configs())
def test_every_configuration_plans_buffers_and_routes_that_fit(c) -> None:
    _check_plan(c)


def test_group_config_refuses_what_fully_shard_refuses() -> None:
    base = GroupConfig(STRATEGIES["optim_grads_params"], MixedPrecisionPolicy().dtypes_for(F32), True)
    bad = [
        dict(strategy=replace(STRATEGIES["optim_grads_params"], shard_grads=False)),  # ZeRO-3 without sharded grads
        dict(strategy=STRATEGIES["no_shard"]),  # no_shard in the chunked layout
        dict(layout=P.LayoutKind.WHOLE),  # a sharded strategy in no_shard's layout
        dict(layout=P.LayoutKind.OWNED, mesh=P.MeshKind.HSDP),
        dict(mesh=P.MeshKind.HFSDP),  # HFSDP in the chunked layout
        dict(mesh=P.MeshKind.HFSDP, layout=P.LayoutKind.ROW, residence=P.ResidenceKind.OPTIM_STATE),
        dict(params=P.ParamsKind.TENSOR_PARALLEL, residence=P.ResidenceKind.HOST),
        dict(params=P.ParamsKind.SUBCLASS, layout=P.LayoutKind.ROW),
        dict(slice_ranks=2, mesh=P.MeshKind.HSDP),
        dict(slice_ranks=1),
        dict(requires_grad=False, replica_reduce=P.ReplicaReduce.DEFERRED),
        dict(requires_grad=False, grads_to=P.GradsTo.EVERY),
    ]
    for change in bad:
        with pytest.raises(ValueError, match="GroupConfig: "):
            replace(base, **change)
    assert replace(base, layout=P.LayoutKind.ROW, mesh=P.MeshKind.HFSDP).mesh is P.MeshKind.HFSDP


def _plans_after_setters() -> list[tuple[str, bool, bool]]:
    """A fake world of 4 on a (2, 2) mesh: after each setter that changes what a plan is compiled
    from, whether every group's plan equals a fresh compile of its configuration, whether its
    reducer runs that plan's route, and whether the setter changed some plan at all."""
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh

    import fsdp
    from fsdp.compose.custom_comm import install
    from fsdp.group.configure import config_of
    from tests.fsdp.test_custom_comm import CountingAllGather

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    fsdp.fully_shard(model[0], mesh=mesh)
    fsdp.fully_shard(model, mesh=mesh)
    groups = [g for m in (model[0], model) for g in fsdp.fully_shard.state(m).groups]
    seen, before = [], [None] * len(groups)

    def check(what: str) -> None:  # (setter, plans fresh, routes handed on, some plan changed)
        fresh = [plan_group(config_of(g)) for g in groups]
        seen.append((what, all(g.plan == f for g, f in zip(groups, fresh)),
                     all(g.grads.route is g.plan.reduce for g in groups), fresh != before))
        before[:] = fresh

    check("fully_shard")
    model.set_requires_all_reduce(False)
    check("set_requires_all_reduce(False)")
    model.set_keep_unsharded_storage(True)
    check("set_keep_unsharded_storage(True)")
    install(groups[0], all_gather_comm=CountingAllGather())
    check("a custom all-gather comm")
    model.to(torch.float64)
    check("module.to(float64)")
    return seen


def test_every_setter_compiles_the_plan_again_and_hands_its_route_on() -> None:
    from tests.harness import run_ranks

    seen = run_ranks(_plans_after_setters, 4, backend="fake")[0]
    assert [w for w, *_ in seen] == ["fully_shard", "set_requires_all_reduce(False)", "set_keep_unsharded_storage(True)",
                                     "a custom all-gather comm", "module.to(float64)"]
    assert all(same and handed and changed for _, same, handed, changed in seen), seen
