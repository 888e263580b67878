"""Checkpoints with DCP: resharding across world sizes and strategies bit for bit, full state
dicts (export on rank 0, load broadcast from rank 0), interrupted saves, clear load errors.

"Bit for bit" compares raw bytes (so -0.0 vs 0.0 or NaN payloads would count as differences).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

import fsdp
from dbuffer import RowShardedDTensor
from fsdp import checkpoint as ckpt
from fsdp.checkpoint import atomic
from fsdp.group.layout_choice import layout_policy
from tests.fsdp.models import loss_fn, make_batches, make_model
from tests.fsdp.test_parity import STRATEGIES, shard
from tests.harness import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


# ----------------------------------------------------------------------------- helpers


def _build(model, strategy: str, policy=None):
    kw = {"sharding_strategy": strategy}
    if policy is not None:
        kw["mp_policy"] = policy
    m = shard(copy.deepcopy(model), True, **kw)
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)


def _steps(m, opt, batches) -> list[float]:
    """Train on this rank's slice of each global batch; this rank's loss per step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for x, y in batches:
        per = x.shape[0] // world
        loss = loss_fn(m, x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _save(m, opt, path: str) -> None:
    msd, osd = ckpt.get_state_dict(m, opt)
    ckpt.save({"model": msd, "optim": osd}, path)


def _load(m, opt, path: str) -> None:
    """ckpt.load into torch's own sharded state dicts, applied with torch's set_state_dict."""
    msd, osd = ckpt.get_state_dict(m, opt)
    state = {"model": msd, "optim": osd}
    ckpt.load(state, path)
    set_state_dict(m, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _full(m, opt):
    """The full state (parameters, AdamW state, hyperparameters) gathered on rank 0, as plain
    CPU tensors; empty dicts elsewhere."""
    return ckpt.get_state_dict(m, opt, options=FULL)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _diff(a, b, path: str = "") -> list[str]:
    """Where ``a`` and ``b`` differ (tensors: dtype, shape and raw bytes)."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{path}: keys {sorted(map(str, a.keys() ^ b.keys()))}"]
        return [d for k in a for d in _diff(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for k, (x, y) in enumerate(zip(a, b)) for d in _diff(x, y, f"{path}[{k}]")]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        same = a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))
        return [] if same else [path]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


# ----------------------------------------------------------------------------- resharding


def _first_leg(model, batches, path: str):
    """World 2, ZeRO-3, Megatron's row-atomic layout (the resumes use FSDP2's default torch.chunk
    pieces, so each load also changes layout): 3 steps, save, then 3 more steps (the uninterrupted run)."""
    with layout_policy("row"):
        m, opt = _build(model, "optim_grads_params")
    _steps(m, opt, batches[:3])
    _save(m, opt, path)
    saved = _full(m, opt)
    # AdamW's state is row-sharded like its parameter, so DCP and full_tensor() see true rows
    kinds = {type(v).__name__ for p in m.parameters() for v in opt.state[p].values() if isinstance(v, DTensor)}
    assert any(isinstance(p, RowShardedDTensor) for p in m.parameters()) and "RowShardedDTensor" in kinds
    return saved, _steps(m, opt, batches[3:])


def _resume(model, batches, strategy: str, src: str, dst):
    """Load ``src`` into a differently initialised model, re-save it as ``dst``, train 3 steps."""
    m, opt = _build(model, strategy)
    _load(m, opt, src)
    loaded = _full(m, opt)
    if dst is not None:
        _save(m, opt, dst)
    return loaded, _steps(m, opt, batches[3:])


def _plain_from(model, saved, batches) -> list[float]:
    """Single-process torch (no fsdp) continuing from a full state dict: the reference."""
    msd, osd = saved
    m = copy.deepcopy(model)
    m.load_state_dict(msd)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    names = [n for n, _ in m.named_parameters()]
    groups = [{**g, "params": [names.index(n) for n in g["params"]]} for g in osd["param_groups"]]
    opt.load_state_dict({"state": {names.index(n): s for n, s in osd["state"].items()}, "param_groups": groups})
    losses = []
    for x, y in batches:
        loss = loss_fn(m, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _global(per_rank: list[list[float]]) -> list[float]:
    """The loss on the global batch per step: the mean of the ranks' equal-sized slices."""
    return [sum(step) / len(step) for step in zip(*per_rank)]


def test_reshard_world2_zero3_to_world4_optim_grads_to_world1_no_shard_and_back(tmp_path) -> None:
    model, other, batches = make_model(), make_model(seed=7), make_batches(6)
    a, b, c = (str(tmp_path / n) for n in "abc")
    first = run_ranks(_first_leg, 2, model, batches, a)
    saved, uninterrupted = first[0][0], [r[1] for r in first]
    assert first[1][0] == ({}, {})  # the full export lives on rank 0 only
    assert len(saved[0]) == len(dict(model.named_parameters())) and len(saved[1]["state"]) == len(saved[0])
    assert all(set(s) == {"step", "exp_avg", "exp_avg_sq"} for s in saved[1]["state"].values())

    world4 = run_ranks(_resume, 4, other, batches, "optim_grads", a, b)
    world1 = run_ranks(_resume, 1, other, batches, "no_shard", b, c)
    back = run_ranks(_resume, 2, other, batches, "optim_grads_params", c, None)
    for name, result in [("world 4 optim_grads", world4), ("world 1 no_shard", world1), ("back", back)]:
        assert _diff(saved, result[0][0]) == [], name  # parameters and AdamW state, bit for bit

    # Back at world 2 / ZeRO-3 the next steps repeat the uninterrupted run exactly.
    assert [r[1] for r in back] == uninterrupted
    # Elsewhere they follow single-process training from the saved state: exactly at world 1
    # (the same arithmetic), within fp32 rounding of the gradient averaging at world 4.
    plain = _plain_from(model, saved, batches[3:])
    assert world1[0][1] == plain
    for losses in (_global(uninterrupted), _global([r[1] for r in world4])):
        assert max(abs(x - y) for x, y in zip(losses, plain)) < 1e-5, (losses, plain)


# ----------------------------------------------------------------------------- every strategy


def _every_strategy(model, other, batches, root: str) -> dict:
    policy = fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    x, y = batches[2]
    out = {}
    for k, strategy in enumerate(STRATEGIES):
        m, opt = _build(model, strategy, policy)
        _steps(m, opt, batches[:2])
        msd = m.state_dict()  # module.state_dict(): DTensors DCP saves as they are
        assert all(isinstance(v, DTensor) for v in msd.values()), strategy
        path = f"{root}/{strategy}"
        ckpt.save({"model": msd, "optim": get_optimizer_state_dict(m, opt)}, path)
        saved = _full(m, opt)
        with torch.no_grad():
            want = loss_fn(m, x, y)
        for target in (strategy, STRATEGIES[(k + 1) % len(STRATEGIES)]):
            m2, opt2 = _build(other, target, policy)
            state = {"model": m2.state_dict(), "optim": get_optimizer_state_dict(m2, opt2)}
            ckpt.load(state, path)
            m2.load_state_dict(state["model"])  # module.load_state_dict()
            set_optimizer_state_dict(m2, opt2, state["optim"])
            with torch.no_grad():  # the bf16 compute weights were refreshed from the loaded ones
                same_loss = torch.equal(loss_fn(m2, x, y), want)
            out[(strategy, target)] = (_diff(saved, _full(m2, opt2)), same_loss)
    return out


def test_every_strategy_saves_and_loads(tmp_path) -> None:
    results = run_ranks(_every_strategy, 2, make_model(), make_model(seed=7), make_batches(3), str(tmp_path))
    for rank_result in results:
        for key, (diff, same_loss) in rank_result.items():
            assert diff == [] and same_loss, (key, diff)
    assert set(results[0]) == {(s, t) for k, s in enumerate(STRATEGIES) for t in (s, STRATEGIES[(k + 1) % 4])}


# ----------------------------------------------------------------------------- full state dicts


def _export(model, batches):
    m, opt = _build(model, "optim_grads_params")
    _steps(m, opt, batches)
    msd, osd = _full(m, opt)
    gathered = {n: p.full_tensor() for n, p in m.named_parameters()}  # DTensor's own gather
    if dist.get_rank() == 0:
        assert all(type(t) is torch.Tensor and t.device.type == "cpu" for t in msd.values())
        assert _diff(msd, gathered) == []
        assert all(type(s["exp_avg"]) is torch.Tensor for s in osd["state"].values())
    else:
        assert msd == {} and osd == {}
    return msd, osd


def _import(other, full, broadcast: bool):
    """Load a full state dict at world 4 (only rank 0 holds it when broadcasting)."""
    rank = dist.get_rank()
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast)
    msd, osd = full if rank == 0 or not broadcast else ({}, {})
    out = {}
    for strategy in ("optim_grads_params", "no_shard"):
        m, opt = _build(other, strategy)
        ckpt.set_state_dict(m, opt, model_state_dict=msd, optim_state_dict=osd, options=options)
        out[strategy] = _full(m, opt)
    # A key missing, or a shape differing, on the source rank fails every rank alike.
    m, opt = _build(other, "optim_grads_params")
    errors = []
    for bad in ({k: v for k, v in msd.items() if k != "head.weight"}, {**msd, "norm.weight": torch.ones(3)}):
        try:
            ckpt.set_state_dict(m, opt, model_state_dict=bad, optim_state_dict=osd, options=options)
            errors.append(None)
        except ckpt.CheckpointError as exc:
            errors.append(str(exc))
    return out, errors


def test_full_state_dict_export_and_load_broadcast_from_rank0() -> None:
    model, other, batches = make_model(), make_model(seed=7), make_batches(2)
    full = run_ranks(_export, 2, model, batches)[0]
    for broadcast in (True, False):
        results = run_ranks(_import, 4, other, full, broadcast)
        for strategy, loaded in results[0][0].items():
            assert _diff(full, loaded) == [], (broadcast, strategy)
        errors = [r[1] for r in results]
        assert all(e == errors[0] for e in errors)  # identical on every rank
        missing, shape = errors[0]
        assert "'head.weight'" in missing and "missing" in missing
        assert "'norm.weight'" in shape and "(3,)" in shape and "(8,)" in shape


# ----------------------------------------------------------------------------- interrupted saves


class _CrashingPlanner(DefaultSavePlanner):
    """Rank 1 fails after writing ``after`` items: a crash in the middle of a save."""

    def __init__(self, after: int) -> None:
        super().__init__()
        self.after, self.done = after, 0

    def resolve_data(self, write_item):
        if dist.get_rank() == 1 and self.done == self.after:
            raise OSError("simulated crash in the middle of a save")
        self.done += 1
        return super().resolve_data(write_item)


def _crash_mid_save(model, other, batches, path: str):
    m, opt = _build(model, "optim_grads_params")
    _steps(m, opt, batches[:2])
    _save(m, opt, path)
    saved = _full(m, opt)
    _steps(m, opt, batches[2:])
    msd, osd = ckpt.get_state_dict(m, opt)
    with pytest.raises(OSError, match="simulated crash"):  # every rank sees the failure
        ckpt.save({"model": msd, "optim": osd}, path, planner=_CrashingPlanner(after=3))
    partial = sorted(os.listdir(path + ckpt.PARTIAL))
    m2, opt2 = _build(other, "optim_grads")
    _load(m2, opt2, path)
    after_crash = _diff(saved, _full(m2, opt2))
    _save(m, opt, path)  # the next save publishes over both
    newer = _full(m, opt)
    m3, opt3 = _build(other, "optim_grads")
    _load(m3, opt3, path)
    return partial, after_crash, _diff(newer, _full(m3, opt3)), sorted(os.listdir(os.path.dirname(path)))


def test_failure_in_the_middle_of_a_save_leaves_the_previous_checkpoint(tmp_path) -> None:
    path = str(tmp_path / "ck")
    results = run_ranks(_crash_mid_save, 2, make_model(), make_model(seed=7), make_batches(3), path)
    partial, after_crash, after_next_save, listing = results[0]
    assert "__0_0.distcp" in partial and ".metadata" not in partial  # half written, never published
    assert after_crash == [] and after_next_save == []
    assert listing == ["ck"]  # published; nothing partial or old left


def _killed_child(path: str) -> None:
    """Run in a fresh interpreter (no process group): save, then die hard inside the next save."""

    class Die(DefaultSavePlanner):
        def resolve_data(self, write_item):
            if write_item.index.fqn == "v":
                os._exit(17)  # no cleanup, no exception handling: like a killed job
            return super().resolve_data(write_item)

    ckpt.save({"u": torch.arange(10.0), "v": torch.ones(4)}, path)
    ckpt.save({"u": torch.arange(10.0) * 2, "v": torch.zeros(4)}, path, planner=Die())


def test_killed_save_leaves_the_previous_checkpoint(tmp_path) -> None:
    path = str(tmp_path / "ck")
    code = f"from tests.fsdp.test_checkpoint import _killed_child; _killed_child({path!r})"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 17, proc.stderr
    assert os.path.isdir(path + ckpt.PARTIAL) and not os.path.exists(os.path.join(path + ckpt.PARTIAL, ".metadata"))
    state = {"u": torch.zeros(10), "v": torch.zeros(4)}
    ckpt.load(state, path)  # no process group: DCP loads in this one process
    assert torch.equal(state["u"], torch.arange(10.0)) and torch.equal(state["v"], torch.ones(4))
    # A crash between the two renames of a publish leaves only <path>.old: load falls back to it.
    os.rename(path, path + ckpt.OLD)
    state = {"u": torch.zeros(10)}
    with pytest.warns(UserWarning, match=r"\.old"):
        ckpt.load(state, path)
    assert torch.equal(state["u"], torch.arange(10.0))


# ----------------------------------------------------------------------------- load errors


def _save_trained(model, batches, path: str) -> bool:
    m, opt = _build(model, "optim_grads_params")
    _steps(m, opt, batches)
    _save(m, opt, path)
    return True


def _try_load(other, path: str, extra: dict) -> tuple:
    """Load into a fresh model; the error (None if it loaded) and whether the model is untouched."""
    m, opt = _build(other, "optim_grads")
    msd, osd = ckpt.get_state_dict(m, opt)
    before = [p._local_tensor.clone() for p in m.parameters()]
    state = {"model": {**msd, **extra}, "optim": osd}
    try:
        ckpt.load(state, path)
        error = None
    except ckpt.CheckpointError as exc:
        error = str(exc)
    untouched = all(torch.equal(b, p._local_tensor) for b, p in zip(before, m.parameters()))
    return error, untouched


def test_load_errors_name_the_key_or_file(tmp_path) -> None:
    model, other = make_model(), make_model(seed=7)
    path = str(tmp_path / "ck")
    run_ranks(_save_trained, 2, model, make_batches(1), path)

    def failures(p, extra=None) -> str:
        results = run_ranks(_try_load, 2, other, p, extra or {})
        assert all(r == results[0] for r in results), results  # the same error on every rank
        error, untouched = results[0]
        assert error is not None and untouched, results[0]  # raised before anything was copied
        return error

    assert "'model.extra.weight'" in failures(path, {"extra.weight": torch.zeros(2)})
    shape = failures(path, {"head.weight": torch.zeros(3, 5)})
    assert "'model.head.weight'" in shape and "(16, 8)" in shape and "(3, 5)" in shape
    assert "no checkpoint at" in failures(str(tmp_path / "nowhere"))

    data = os.path.join(path, "__1_0.distcp")
    original = open(data, "rb").read()
    corrupted = bytearray(original)
    corrupted[len(corrupted) // 2] ^= 0x40
    for name, content, words in [
        ("bit flip", bytes(corrupted), "corrupted"),
        ("truncated", original[: len(original) // 2], "bytes"),
        ("deleted", None, "missing"),
    ]:
        if content is None:
            os.remove(data)
        else:
            open(data, "wb").write(content)
        error = failures(path)
        assert data in error and words in error, (name, error)
    open(data, "wb").write(original)
    assert run_ranks(_try_load, 2, other, path, {}) == [(None, False)] * 2  # intact again: loads

    os.remove(os.path.join(path, ".metadata"))
    assert ".metadata is missing" in failures(path)
    with pytest.raises(ckpt.CheckpointError, match="not a checkpoint"):
        ckpt.save({"u": torch.zeros(1)}, path)  # a non-empty directory without metadata is kept


# ----------------------------------------------------------------------------- what a save never touches


def _save_refusals(root: str) -> dict:
    """Every rank tries each save; rank 0 prepares the paths. A save must raise the same
    CheckpointError on every rank, before touching anything that is not a checkpoint."""
    rank = dist.get_rank()
    state = {"u": torch.arange(6.0)}
    cases = {
        "file": ("file", "is a file"),
        "foreign_dir": ("dir", "is not a checkpoint (it holds notes.txt"),
        "partial_dir": ("partial", "is not a checkpoint (it holds notes.txt"),
        "old_dir": ("old", "is not a checkpoint (it holds notes.txt"),
        "link": ("link", "symbolic link"),
    }
    if rank == 0:
        for name, (kind, _) in cases.items():
            path = os.path.join(root, name)
            if kind == "file":
                open(path, "w").write("user data")
            elif kind == "link":
                os.makedirs(path + "_target")
                os.symlink(path + "_target", path)
            else:
                target = {"dir": path, "partial": path + ckpt.PARTIAL, "old": path + ckpt.OLD}[kind]
                os.makedirs(target)
                open(os.path.join(target, "notes.txt"), "w").write("user data")
    dist.barrier()
    listing = sorted(os.listdir(root))
    out = {}
    for name, (_, words) in cases.items():
        try:
            ckpt.save(state, os.path.join(root, name))
            out[name] = "saved"
        except ckpt.CheckpointError as exc:
            message = str(exc)
            out[name] = "ok" if words in message and "choose another path" in message else message
    assert sorted(os.listdir(root)) == listing  # nothing moved, created or deleted
    if rank == 0:
        assert open(os.path.join(root, "file")).read() == "user data"
    # Rank 0 decides for every rank: one that would see a clean path still raises with it.
    real = atomic._not_ours
    atomic._not_ours = real if rank == 0 else (lambda path: None)
    try:
        ckpt.save(state, os.path.join(root, "file"))
        out["rank0_decides"] = "saved"
    except ckpt.CheckpointError as exc:
        out["rank0_decides"] = "ok" if "is a file" in str(exc) else str(exc)
    finally:
        atomic._not_ours = real
    # A checkpoint (with its leftovers) is replaced as before.
    good = os.path.join(root, "good")
    ckpt.save(state, good)
    ckpt.save({"u": torch.arange(6.0) * 2}, good)
    loaded = {"u": torch.zeros(6)}
    ckpt.load(loaded, good)
    out["replaced"] = "ok" if torch.equal(loaded["u"], torch.arange(6.0) * 2) else "stale"
    return out


def test_save_never_replaces_what_it_did_not_write(tmp_path) -> None:
    results = run_ranks(_save_refusals, 2, str(tmp_path), backend="gloo", timeout=60)
    expected = dict.fromkeys(["file", "foreign_dir", "partial_dir", "old_dir", "link", "rank0_decides", "replaced"], "ok")
    assert results[0] == results[1] == expected, results


# ----------------------------------------------------------------------------- resume or start fresh


def _resume_or_fresh(m, opt, path: str) -> int:
    """fsdp/README.md's resume loop: the state dict is built only when there is a checkpoint to load."""
    if os.path.exists(path) or os.path.exists(path + ckpt.OLD):
        msd, osd = ckpt.get_state_dict(m, opt)
        state = {"model": msd, "optim": osd, "step": 0}
        ckpt.load(state, path)
        ckpt.set_state_dict(m, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        return state["step"]
    return 0


def _fresh_starts(model, batches, root: str) -> dict:
    out = {}
    for how in ("plain", "loop", "state dict first"):
        m, opt = _build(model, "optim_grads_params")
        if how == "loop":
            assert _resume_or_fresh(m, opt, os.path.join(root, "none")) == 0
            assert not opt.state  # nothing built, nothing initialised
        elif how == "state dict first":
            ckpt.get_state_dict(m, opt)  # torch creates AdamW's state: one step at lr 0
            assert all(int(s["step"]) == 1 for s in opt.state.values()) and len(opt.state) > 0
        _steps(m, opt, batches[:2])
        out[how] = _full(m, opt)
        if how == "loop":  # and the same loop resumes where a save left off
            msd, osd = ckpt.get_state_dict(m, opt)
            ckpt.save({"model": msd, "optim": osd, "step": 2}, os.path.join(root, "ck"))
            m2, opt2 = _build(model, "optim_grads")
            out["resumed step"] = _resume_or_fresh(m2, opt2, os.path.join(root, "ck"))
            out["resumed"] = _full(m2, opt2)
    return out


def test_state_dict_built_only_to_load_keeps_a_fresh_start_fresh(tmp_path) -> None:
    out = run_ranks(_fresh_starts, 2, make_model(), make_batches(2), str(tmp_path))[0]
    assert _diff(out["plain"], out["loop"]) == []  # the guide's loop without a checkpoint: a true fresh start
    assert out["resumed step"] == 2 and _diff(out["loop"], out["resumed"]) == []
    # What fsdp/README.md warns about: building the state dict of a never-stepped AdamW "in case" makes
    # its first real step the second (bias correction), so training differs from a fresh start.
    assert _diff(out["plain"], out["state dict first"]) != []
