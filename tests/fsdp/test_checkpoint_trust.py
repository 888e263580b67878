"""Checkpoints from someone else (issue 46): loading one never runs code it names and never reads
a file outside its own directory, even when its ``.checksums`` was rewritten to match (with the
project's own ``write_checksums``, as anyone who writes ``.metadata`` can).

Each crafted checkpoint is a copy of a real one (world 2, ZeRO-3, AdamW, a ``"step"`` entry):

* ``metadata_payload``: ``.metadata`` also holds an object whose ``__reduce__`` calls
  ``builtins.eval``, which writes a marker file and returns a harmless string;
* ``entry_payload``: the ``"step"`` entry is such an object (a ``torch.save`` blob appended to a
  data file, ``.metadata`` pointing at it);
* ``absolute`` / ``dotdot`` / ``link``: ``.metadata`` names the data files of another checkpoint
  (``other``, saved one step later) by absolute path, by ``../``, or through a symbolic link
  inside the checkpoint.

Loaded on every rank of a gloo world, each raises the same ``CheckpointError`` naming the file
and what it named, before anything is copied, and no marker file exists. The code before this
change ran both payloads and loaded ``other``'s values from all three (the report of issue 46).
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import shutil
from fractions import Fraction

import pytest
import torch
from torch.distributed.checkpoint.state_dict import set_state_dict

from fsdp import checkpoint as ckpt
from fsdp.checkpoint.files import CHECKSUMS, METADATA, crc32, write_checksums
from fsdp.group.layout_choice import layout_policy
from tests.fsdp.models import make_batches, make_model
from tests.fsdp.test_checkpoint import _build, _diff, _full, _steps
from tests.fsdp.test_checkpoint_damage import _same, _snapshot
from tests.harness import run_ranks


class _Payload:
    """Unpickled, runs ``eval``: writes ``marker`` and evaluates to ``value`` (so a load that
    runs it goes on as if nothing happened)."""

    def __init__(self, marker: str, value) -> None:
        self.marker, self.value = marker, value

    def __reduce__(self):
        code = f"__import__('pathlib').Path({self.marker!r}).write_text('ran') and {self.value!r}"
        return (eval, (code,))


# ----------------------------------------------------------------------------- rank functions


def _save_pair(model, batches, root: str):
    """``ck`` after one step (``"step": 1``) and ``other`` after two (``"step": 2``); rank 0
    returns both full states."""
    with layout_policy("row"):
        m, opt = _build(model, "optim_grads_params")
    fulls = []
    for k, name in enumerate(("ck", "other")):
        _steps(m, opt, batches[k : k + 1])
        msd, osd = ckpt.get_state_dict(m, opt)
        ckpt.save({"model": msd, "optim": osd, "step": k + 1}, os.path.join(root, name))
        fulls.append(_full(m, opt))
    return fulls


def _attempts(other, batch, cases: list) -> list:
    """Load each ``(path, keywords)``: ``("error", message, state unchanged)`` or ``("loaded",
    full state on rank 0, step)``."""
    out = []
    for path, keywords in cases:
        m, opt = _build(other, "optim_grads")
        _steps(m, opt, [batch])
        msd, osd = ckpt.get_state_dict(m, opt)
        state = {"model": msd, "optim": osd, "step": 0}
        before = _snapshot(m, opt)
        try:
            ckpt.load(state, path, **keywords)
        except ckpt.CheckpointError as exc:
            out.append(("error", str(exc), _same(before, _snapshot(m, opt))))
            continue
        set_state_dict(m, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        out.append(("loaded", _full(m, opt), state["step"]))
    return out


# ----------------------------------------------------------------------------- crafting


def _metadata(path: str):
    with open(os.path.join(path, METADATA), "rb") as f:
        return pickle.load(f)  # our own fresh checkpoint: trusted here


def _rewrite(path: str, metadata, extra: tuple = ()) -> None:
    """Write ``metadata`` as ``.metadata`` and ``.checksums`` to match it, every file of the
    directory and the ``extra`` names (as given, relative to ``path``) included."""
    with open(os.path.join(path, METADATA), "wb") as f:
        pickle.dump(metadata, f)
    names = [n for n in os.listdir(path) if n != CHECKSUMS] + list(extra)
    write_checksums(path, {n: crc32(os.path.join(path, n)) for n in names})


def _copy(root: str, name: str) -> str:
    path = os.path.join(root, "cases", name)
    shutil.copytree(os.path.join(root, "ck"), path, symlinks=True)
    return path


def craft(root: str, markers: dict) -> dict:
    """Each crafted copy of ``root/ck`` by name (``markers``: name -> marker file)."""
    out = {}
    path = out["metadata_payload"] = _copy(root, "metadata_payload")
    md = _metadata(path)
    md.storage_meta.modules = [_Payload(markers["metadata_payload"], "torch.nn")]
    _rewrite(path, md)

    path = out["entry_payload"] = _copy(root, "entry_payload")
    md = _metadata(path)
    index = next(i for i in md.storage_data if i.fqn == "step")
    info = md.storage_data[index]
    blob = io.BytesIO()
    torch.save(_Payload(markers["entry_payload"], 1), blob)
    file = os.path.join(path, info.relative_path)
    offset = os.path.getsize(file)
    with open(file, "ab") as f:
        f.write(blob.getvalue())
    md.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(blob.getvalue()))
    _rewrite(path, md)

    other = os.path.join(root, "other")
    for kind in ("absolute", "dotdot", "link"):
        path = out[kind] = _copy(root, kind)
        md, theirs = _metadata(path), _metadata(other).storage_data
        if kind == "absolute":
            name = {n: os.path.join(other, n) for n in {i.relative_path for i in theirs.values()}}
        elif kind == "dotdot":
            name = {n: os.path.join("..", "..", "other", n) for n in {i.relative_path for i in theirs.values()}}
        else:
            name = {}
            for k, n in enumerate(sorted({i.relative_path for i in theirs.values()})):
                name[n] = f"__{k}_9.distcp"
                os.symlink(os.path.join(other, n), os.path.join(path, name[n]))
        md.storage_data = {i: dataclasses.replace(s, relative_path=name[s.relative_path]) for i, s in theirs.items()}
        _rewrite(path, md, extra=tuple(name.values()) if kind != "link" else ())
    return out


# ----------------------------------------------------------------------------- the cases


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("trust"))
    ck, other = run_ranks(_save_pair, 2, make_model(), make_batches(2), root)[0]
    markers = {k: os.path.join(root, f"{k}.ran") for k in ("metadata_payload", "entry_payload")}
    return root, ck, other, markers, craft(root, markers)


def test_crafted_checkpoints_run_nothing_and_read_nothing_outside(saved) -> None:
    root, _, _, markers, cases = saved
    names = list(cases)
    per_rank = run_ranks(_attempts, 2, make_model(seed=7), make_batches(1)[0], [(cases[n], {}) for n in names])
    assert per_rank[0] == per_rank[1], per_rank  # the same error on every rank
    results = dict(zip(names, per_rank[0]))
    for name, result in results.items():
        assert result[0] == "error", (name, result[:1])
        assert result[2], (name, result[1])  # refused before anything was copied
    for marker in markers.values():
        assert not os.path.exists(marker), marker  # and nothing ran
    md = lambda name: os.path.join(cases[name], METADATA)  # noqa: E731
    message = results["metadata_payload"][1]
    assert md("metadata_payload") in message and "builtins.eval" in message and "trust_pickled_objects" in message
    message = results["entry_payload"][1]
    assert "'step'" in message and "builtins.eval" in message and "weights_only=True" in message, message
    data = os.path.join(cases["entry_payload"], "__0_0.distcp")
    assert data in message or data.replace("__0_", "__1_") in message, message
    other = os.path.join(root, "other")
    message = results["absolute"][1]
    assert md("absolute") in message and repr(os.path.join(other, "__0_0.distcp")) in message, message
    message = results["dotdot"][1]
    assert md("dotdot") in message and "'../../other/__0_0.distcp'" in message and "plain file name" in message
    message = results["link"][1]
    assert os.path.join(cases["link"], "__0_9.distcp") in message and "not a regular file" in message, message


def test_the_same_files_untampered_still_load_exactly(saved) -> None:
    """The refusals above come from what was crafted: ``ck`` and ``other`` load bit for bit, with
    their ``"step"`` (a non-tensor entry read with ``weights_only=True``)."""
    root, ck, other, _, _ = saved
    cases = [(os.path.join(root, "ck"), {}), (os.path.join(root, "other"), {})]
    results = run_ranks(_attempts, 2, make_model(seed=7), make_batches(1)[0], cases)[0]
    assert results[0][0] == "loaded" and _diff(ck, results[0][1]) == [] and results[0][2] == 1
    assert results[1][0] == "loaded" and _diff(other, results[1][1]) == [] and results[1][2] == 2


def test_a_users_own_object_needs_an_explicit_opt_in(tmp_path) -> None:
    """A non-tensor entry of a class of the user's own is refused by default, naming the class
    and both ways in: torch's ``safe_globals`` (that class only) and ``trust_pickled_objects``."""
    path = str(tmp_path / "own")
    ckpt.save({"w": torch.arange(4.0), "ratio": Fraction(1, 3)}, path)
    state = {"w": torch.zeros(4), "ratio": None}
    with pytest.raises(ckpt.CheckpointError) as refused:
        ckpt.load(state, path)
    message = str(refused.value)
    assert "'ratio'" in message and "fractions.Fraction" in message, message
    assert "add_safe_globals" in message and "trust_pickled_objects=True" in message, message
    assert torch.equal(state["w"], torch.zeros(4)) and state["ratio"] is None  # nothing copied
    with torch.serialization.safe_globals([Fraction]):
        ckpt.load(state, path)
    assert state["ratio"] == Fraction(1, 3) and torch.equal(state["w"], torch.arange(4.0))
    state = {"w": torch.zeros(4), "ratio": None}
    ckpt.load(state, path, trust_pickled_objects=True)
    assert state["ratio"] == Fraction(1, 3) and torch.equal(state["w"], torch.arange(4.0))


def test_trust_pickled_objects_never_widens_where_a_load_reads(saved) -> None:
    root, _, _, _, cases = saved
    for kind in ("absolute", "dotdot", "link"):
        state = {"step": 0}
        with pytest.raises(ckpt.CheckpointError, match="plain file name|not a regular file"):
            ckpt.load(state, cases[kind], trust_pickled_objects=True)
        assert state == {"step": 0}


def test_metadata_state_is_set_only_on_dcp_objects_in_their_fields() -> None:
    """A pickle's ``BUILD`` on a class (here DCP's ``Metadata`` itself, which every load shares)
    would set a class attribute with plain pickle; the metadata reader refuses it, and a
    field that is not one of the dataclass's."""
    from torch.distributed.checkpoint.metadata import Metadata

    from fsdp.checkpoint.unpickler import Refused, read_metadata

    on_class = (b"\x80\x04" b"c" b"torch.distributed.checkpoint.metadata\nMetadata\n"
                b"N}\x8c\x05pwned\x8c\x03yes\x73\x86b.")  # (None, {'pwned': 'yes'}): set as attributes
    assert pickle.loads(on_class) is Metadata and Metadata.pwned == "yes"  # what plain pickle does
    del Metadata.pwned
    with pytest.raises(Refused, match="state set on a builtins.type"):
        read_metadata(on_class, False)
    assert not hasattr(Metadata, "pwned")
    extra_field = pickle.dumps(Metadata({})).replace(b"planner_data", b"planner_datX")
    with pytest.raises(Refused, match="not its fields"):
        read_metadata(extra_field, False)
    assert read_metadata(pickle.dumps(Metadata({})), False) == Metadata({})
