"""Damaged checkpoints (issue 25): every file a save writes is verified before anything is read,
and any damage raises the same ``CheckpointError`` naming the file on every rank, leaving the
model and optimizer given to the load exactly as they were (bit for bit, parameters and AdamW
state). A checkpoint without ``.checksums`` (plain ``dcp.save``, FSDP2) loads only with
``allow_unverified=True``.

One checkpoint is saved per session (world 2, ZeRO-3, row-atomic layout); each case damages a
copy of it, and one gloo call tries many copies (the target is ZeRO-2 with FSDP2's default
layout, so every load also reshards).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.state_dict import set_state_dict

from fsdp import checkpoint as ckpt
from fsdp.checkpoint import atomic
from fsdp.group.layout_choice import layout_policy
from tests.fsdp.models import make_batches, make_model
from tests.fsdp.test_checkpoint import _bits, _build, _diff, _full, _save, _steps
from tests.harness import run_ranks
from tests.hypothesis_profiles import examples

DATA = ("__0_0.distcp", "__1_0.distcp")
FILES = (".checksums", ".metadata", *DATA)


# ----------------------------------------------------------------------------- rank functions


def _save_two(model, batches, root: str):
    """Train ZeRO-3 (row-atomic), save ``old`` after one step and ``ck`` after two; also a plain
    ``dcp.save`` of the same state as ``foreign``. Rank 0 returns the full state of ``ck``."""
    with layout_policy("row"):
        m, opt = _build(model, "optim_grads_params")
    _steps(m, opt, batches[:1])
    _save(m, opt, os.path.join(root, "old"))
    _steps(m, opt, batches[1:2])
    _save(m, opt, os.path.join(root, "ck"))
    msd, osd = ckpt.get_state_dict(m, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(root, "foreign"))
    return _full(m, opt)


def _snapshot(m, opt) -> list:
    """Every bit of this rank's parameters and optimizer state, and the hyperparameters."""
    out = [_bits(p._local_tensor).clone() for p in m.parameters()]
    for p in m.parameters():
        for key, value in sorted(opt.state[p].items()):
            local = value._local_tensor if hasattr(value, "_local_tensor") else value
            out.append((key, _bits(local).clone() if isinstance(local, torch.Tensor) else local))
    out.append([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
    return out


def _same(a: list, b: list) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, tuple):
            (kx, x), (ky, y) = x, y
            if kx != ky:
                return False
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor) and not torch.equal(x, y):
            return False
        if not isinstance(x, torch.Tensor) and x != y:
            return False
    return True


def _attempts(other, batch, cases: list) -> list:
    """Load each ``(path, allow_unverified)`` into a model trained one step from another init (so
    its AdamW state is live and differs from the checkpoint's). Per case: ``("error", message,
    unchanged)``, or ``("loaded", full state on rank 0)``."""
    out = []
    m = None
    for path, allow_unverified in cases:
        if m is None:  # a fresh target after each successful load
            m, opt = _build(other, "optim_grads")
            _steps(m, opt, [batch])
        msd, osd = ckpt.get_state_dict(m, opt)
        state = {"model": msd, "optim": osd}
        before = _snapshot(m, opt)
        try:
            ckpt.load(state, path, allow_unverified=allow_unverified)
        except ckpt.CheckpointError as exc:
            out.append(("error", str(exc), _same(before, _snapshot(m, opt))))
            continue
        set_state_dict(m, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        out.append(("loaded", _full(m, opt)))
        m = None
    return out


def _one_rank_fails(other, batch, path: str) -> tuple:
    """Rank 1 alone finds a data file bad (rank 0 verified the rest): every rank raises rank 1's
    error, and nothing was copied on either."""
    m, opt = _build(other, "optim_grads")
    _steps(m, opt, [batch])
    msd, osd = ckpt.get_state_dict(m, opt)
    before = _snapshot(m, opt)
    real = atomic.check_file

    def check(directory, name, sums):
        if dist.get_rank() == 1:
            raise ckpt.CheckpointError(f"checkpoint file {os.path.join(directory, name)} seen bad by rank 1")
        return real(directory, name, sums)

    atomic.check_file = check
    try:
        ckpt.load({"model": msd, "optim": osd}, path)
        error = None
    except ckpt.CheckpointError as exc:
        error = str(exc)
    finally:
        atomic.check_file = real
    return error, _same(before, _snapshot(m, opt))


# ----------------------------------------------------------------------------- fixtures, helpers


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(root holding ck, old and foreign; the full state of ck on rank 0)."""
    root = str(tmp_path_factory.mktemp("damage"))
    full = run_ranks(_save_two, 2, make_model(), make_batches(2), root)[0]
    assert sorted(os.listdir(os.path.join(root, "ck"))) == sorted(FILES)
    return root, full


def _copy(root: str, name: str, source: str = "ck") -> str:
    path = os.path.join(root, "cases", name)
    shutil.copytree(os.path.join(root, source), path)
    return path


def _flip(file: str, byte: int, bit: int) -> None:
    content = bytearray(open(file, "rb").read())
    if not content:  # nothing left to flip
        return
    content[byte % len(content)] ^= 1 << bit
    open(file, "wb").write(bytes(content))


def _truncate(file: str, size: int) -> None:
    content = open(file, "rb").read()
    open(file, "wb").write(content[:size])


def _run(cases: list) -> list:
    """Every case's result, the same on every rank (error messages and whether the state was
    untouched; rank 0 alone holds a loaded full state)."""
    results = run_ranks(_attempts, 2, make_model(seed=7), make_batches(1)[0], cases)
    for k in range(len(cases)):
        if results[0][k][0] == "error":
            assert all(r[k] == results[0][k] for r in results), (cases[k], [r[k] for r in results])
        else:
            assert all(r[k][0] == "loaded" for r in results), (cases[k], [r[k][:2] for r in results])
    return results[0]


def _refused(result, file: str, *words: str) -> str:
    """The message of a refusal that names ``file`` and ``words`` and left the state untouched."""
    assert result[0] == "error", result[0]
    _, message, unchanged = result
    assert unchanged, message  # refused before anything was copied into the model or optimizer
    assert file in message and all(w in message for w in words), (file, words, message)
    return message


# ----------------------------------------------------------------------------- the cases


def test_missing_checksums_is_refused_unless_allow_unverified(saved) -> None:
    root, full = saved
    gone = _copy(root, "gone")
    os.remove(os.path.join(gone, ".checksums"))
    flipped = _copy(root, "gone_flipped")  # the case: no .checksums and a shard damaged
    os.remove(os.path.join(flipped, ".checksums"))
    _flip(os.path.join(flipped, DATA[1]), 1000, 3)
    foreign = os.path.join(root, "foreign")  # plain dcp.save
    results = _run([(gone, False), (flipped, False), (foreign, False), (gone, True), (foreign, True)])
    for result, path in zip(results[:3], (gone, flipped, foreign)):
        _refused(result, os.path.join(path, ".checksums"), "is missing", "allow_unverified=True", "dcp.save")
    for result in results[3:]:  # the explicit opt-in loads them, exactly
        assert result[0] == "loaded" and _diff(full, result[1]) == []


def test_damaged_metadata_is_refused_naming_it(saved) -> None:
    root, _ = saved
    md = lambda path: os.path.join(path, ".metadata")  # noqa: E731
    size = os.path.getsize(md(os.path.join(root, "ck")))
    cases, kinds = [], []
    for k in range(40):  # single-bit flips spread over the file, every bit position
        path = _copy(root, f"md_flip{k}")
        _flip(md(path), k * size // 40, k % 8)
        cases.append((path, False))
        kinds.append("corrupted")
    for name, keep in (("md_half", size // 2), ("md_empty", 0)):
        path = _copy(root, name)
        _truncate(md(path), keep)
        cases.append((path, False))
        kinds.append("bytes")
    path = _copy(root, "md_longer")
    open(md(path), "ab").write(b"\0")
    cases.append((path, True))  # verified all the same: the checkpoint has .checksums
    kinds.append("bytes")
    for (path, _), result, kind in zip(cases, _run(cases), kinds):
        _refused(result, md(path), "checkpoint metadata file", kind, "restore it")


def test_damaged_checksums_file_is_refused_naming_it(saved) -> None:
    root, full = saved
    cs = lambda path: os.path.join(path, ".checksums")  # noqa: E731
    size = os.path.getsize(cs(os.path.join(root, "ck")))
    damage = {
        "cs_garbage": lambda f: open(f, "wb").write(b"garbage\n"),
        "cs_empty": lambda f: _truncate(f, 0),
        "cs_half": lambda f: _truncate(f, size // 2),
        "cs_no_trailer": lambda f: _truncate(f, open(f, "rb").read().rindex(b"crc32")),
        "cs_digit": lambda f: _flip(f, size // 3, 0),  # a size or CRC in the JSON
        "cs_own_crc": lambda f: _flip(f, size - 2, 0),  # the trailer line
    }
    cases = []
    for name, fn in damage.items():
        path = _copy(root, name)
        fn(cs(path))
        cases.append((path, True))  # allow_unverified does not excuse a damaged .checksums
    # .checksums of an earlier fsdp.checkpoint (data files only): refused, or with the opt-in
    # loaded with its data files still verified
    legacy = _copy(root, "cs_legacy")
    sums = json.loads(open(cs(legacy), "rb").read().rsplit(b"\ncrc32", 1)[0])["files"]
    del sums[".metadata"]
    open(cs(legacy), "w").write(json.dumps({"crc32": sums}))
    legacy_flipped = _copy(root, "cs_legacy_flipped")
    shutil.copy(cs(legacy), cs(legacy_flipped))
    _flip(os.path.join(legacy_flipped, DATA[0]), 700, 5)
    cases += [(legacy, False), (legacy_flipped, True), (legacy, True)]
    results = _run(cases)
    for (path, _), result in zip(cases, results[: len(damage)]):
        _refused(result, cs(path), "checksum file", "is damaged", "restore it")
    _refused(results[-3], cs(legacy), "earlier fsdp.checkpoint", "allow_unverified=True")
    _refused(results[-2], os.path.join(legacy_flipped, DATA[0]), "corrupted")
    assert results[-1][0] == "loaded" and _diff(full, results[-1][1]) == []


def test_damaged_missing_swapped_or_stale_data_files_are_refused(saved) -> None:
    root, full = saved
    cases, expect = [], []
    for name in DATA:
        data = lambda path: os.path.join(path, name)  # noqa: E731
        size = os.path.getsize(data(os.path.join(root, "ck")))
        for kind, fn, words in [
            ("flip", lambda f: _flip(f, size // 2, 6), "corrupted"),
            ("half", lambda f: _truncate(f, size // 2), "bytes"),
            ("empty", lambda f: _truncate(f, 0), "bytes"),
            ("missing", os.remove, "missing"),
            ("stale", lambda f: shutil.copy(os.path.join(root, "old", name), f), "corrupted"),
        ]:
            path = _copy(root, f"{name}_{kind}")
            fn(data(path))
            cases.append((path, False))
            expect.append((data(path), words))
    swapped = _copy(root, "swapped")  # the two ranks' files exchanged
    a, b = (os.path.join(swapped, n) for n in DATA)
    os.rename(a, a + ".tmp")
    os.rename(b, a)
    os.rename(a + ".tmp", b)
    cases.append((swapped, False))
    stray = _copy(root, "stray")  # a file no save wrote and nothing reads: harmless
    open(os.path.join(stray, "notes.txt"), "w").write("user data")
    cases.append((stray, False))
    results = _run(cases)
    for result, (file, words) in zip(results, expect):
        _refused(result, file, "checkpoint file", words)
    message = _refused(results[-2], swapped, "checkpoint file")
    assert a in message or b in message, message
    assert results[-1][0] == "loaded" and _diff(full, results[-1][1]) == []


def test_empty_directory_is_refused(saved) -> None:
    root, _ = saved
    empty = os.path.join(root, "cases", "empty")
    os.makedirs(empty)
    _refused(_run([(empty, False)])[0], os.path.join(empty, ".metadata"), "is missing")


def test_a_rank_alone_finding_a_bad_file_fails_every_rank_before_any_copy(saved) -> None:
    root, _ = saved
    results = run_ranks(_one_rank_fails, 2, make_model(seed=7), make_batches(1)[0], os.path.join(root, "ck"))
    assert results[0] == results[1], results
    error, unchanged = results[0]
    assert error is not None and "seen bad by rank 1" in error and unchanged


# ----------------------------------------------------------------------------- any damage


_damage = st.tuples(
    st.sampled_from(FILES),
    st.sampled_from(["flip", "flips", "truncate", "append", "delete", "rewrite", "stray"]),
    st.floats(0, 1, exclude_max=True),
    st.integers(0, 2**16 - 1),
)


def _apply(path: str, damage) -> None:
    name, kind, where, bits = damage
    file = os.path.join(path, name)
    size = os.path.getsize(file)
    if kind == "flip":
        _flip(file, int(where * size), bits % 8)
    elif kind == "flips":  # up to 16 bits, anywhere
        for k in range(16):
            if bits >> k & 1:
                _flip(file, int(where * size) + 97 * k, k % 8)
    elif kind == "truncate":
        _truncate(file, int(where * size))
    elif kind == "append":
        open(file, "ab").write(bytes([bits & 255]) * (1 + bits % 7))
    elif kind == "delete":
        os.remove(file)
    elif kind == "rewrite":  # the same bytes written again: still the checkpoint that was saved
        content = open(file, "rb").read()
        open(file, "wb").write(content)
    else:
        open(os.path.join(path, f"stray{bits}"), "wb").write(b"x")


def _content(path: str) -> dict:
    return {n: open(os.path.join(path, n), "rb").read() for n in FILES if os.path.exists(os.path.join(path, n))}


@settings(max_examples=examples(6), deadline=None)
@given(st.lists(st.lists(_damage, min_size=1, max_size=3), min_size=1, max_size=8))
def test_any_damage_loads_the_exact_state_or_raises_with_the_model_unchanged(saved, copies) -> None:
    root, full = saved
    shutil.rmtree(os.path.join(root, "cases", "any"), ignore_errors=True)
    pristine = _content(os.path.join(root, "ck"))
    cases, changed = [], []
    for k, damages in enumerate(copies):
        path = _copy(root, os.path.join("any", str(k)))
        for damage in damages:
            if os.path.exists(os.path.join(path, damage[0])):
                _apply(path, damage)
        now = _content(path)
        changed.append([n for n in FILES if now.get(n) != pristine[n]])
        cases.append((path, False))
    for (path, _), damages, names, result in zip(cases, copies, changed, _run(cases)):
        if not names:  # every file as saved (rewritten, or a stray file beside them): loads exactly
            assert result[0] == "loaded" and _diff(full, result[1]) == [], (damages, result[:2])
        else:  # refused, naming a damaged file, before anything was copied
            assert result[0] == "error", (damages, names)
            _, message, unchanged = result
            assert unchanged, (damages, message)
            assert any(os.path.join(path, n) in message for n in names), (damages, names, message)
