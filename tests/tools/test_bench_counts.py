"""``tools/bench_fsdp.py --counts`` (tools/step_bench/counts.py): per model, ours on both layouts
makes no more all-gathers, reduce-scatters or collectives in all than torch FSDP2, counted in
the same run on 2 gloo ranks; and the counts are what a ZeRO-3 step of that model must make."""

from __future__ import annotations

import functools

import pytest

from tests.harness import run_ranks
from tools.step_bench.counts import KINDS, excess, format_counts, run_counts, split_kinds

# The counts do not depend on sizes (nor on which c10d calls carry them): the smallest model that
# has every unit.
TINY = dict(dtypes=("fp32",), vocab=512, dim=64, layers=2, heads=4, hidden=128, seq=16, batch=2, warmup=1)
# ZeRO-3, FSDP2's schedule: every unit gathered in forward, every unit but the root gathered
# again in backward (the root stays gathered), every unit reduce-scattered once.
UNITS = {"llama": 3, "head_root": 4, "float8": 3}


@functools.lru_cache(maxsize=None)
def _counts(model: str) -> dict:
    return run_ranks(run_counts, 2, TINY, (model,), backend="gloo", timeout=120)[0]


@pytest.mark.parametrize("model", list(UNITS))
def test_counts_are_each_libraries_zero3_schedule(model: str) -> None:
    report = _counts(model)
    got = report["modes"]["fp32"][model]
    assert set(got) == {"ours", "row", "fsdp2"}
    units = UNITS[model]
    fsdp2 = split_kinds(got["fsdp2"]["collectives"])
    assert (fsdp2["all_gather"], fsdp2["reduce_scatter"], fsdp2["all"]) == (2 * units - 1, units, 3 * units - 1)
    assert got["fsdp2"]["library_ops"] == 0  # FSDP2 calls c10d itself
    for name in ("ours", "row"):
        m = got[name]
        # Every collective of ours goes through dbuffer.collectives (CONTRIBUTING: the buffer owns
        # communication), so each is counted as the operation it implements.
        assert m["library_ops"] == sum(m["collectives"].values()) > 0, m
        assert split_kinds(m["collectives"])["all_gather"] >= 2 * units - 1
        assert m["same_on_every_rank"]
        # The same weights on the same batch: the same loss, whichever library shards them.
        assert abs(m["loss"] - got["fsdp2"]["loss"]) <= 1e-5 * abs(got["fsdp2"]["loss"])
        assert abs(m["bytes_sent"] / got["fsdp2"]["bytes_sent"] - 1) < 0.05


@pytest.mark.parametrize("model", [
    "llama", "head_root", "float8",
])
def test_counts_ours_never_more_than_fsdp2(model: str) -> None:
    report = _counts(model)
    got = report["modes"]["fp32"][model]
    for name in ("ours", "row"):
        assert excess(got[name], got["fsdp2"]) == [], format_counts(report)
    assert "MORE" not in format_counts(report)


def test_excess_names_each_kind_over_fsdp2() -> None:
    ours = {"collectives": {"all_gather": 10, "reduce_scatter": 3, "broadcast": 1}}
    fsdp2 = {"collectives": {"all_gather": 5, "reduce_scatter": 3}}
    assert excess(ours, fsdp2) == ["all_gather 10 > 5", "all 14 > 8"]
    assert excess(fsdp2, fsdp2) == []
    assert split_kinds(ours["collectives"]) == {"all_gather": 10, "reduce_scatter": 3, "all_reduce": 0,
                                                "other": 1, "all": 14}
    assert set(KINDS) < set(split_kinds({}))
