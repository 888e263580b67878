"""tools/bench_muon.py: the communication it predicts is what Owned Muon and the naive
gather-every-matrix Muon really send (counted on 2 gloo ranks), and both land on the same weights."""

from __future__ import annotations

from tests.harness import run_ranks
from tools.bench_muon import MEASURED_MLP, measure, mlp_shapes


def _bench_measure() -> dict:
    result = measure(mlp_shapes(MEASURED_MLP))
    predicted = result["predicted"]
    return {
        "same": result["same"],
        "ops": {k: v["ops"] for k, v in result["stats"].items()},
        "sent": {k: v["bytes_sent"] for k, v in result["stats"].items()},
        "predicted": {"owned": predicted.owned, "gather": predicted.gather},
    }


def test_bench_muon_counts_what_it_predicts() -> None:
    """The report's arithmetic matches the c10d calls really made (counted on gloo), Owned Muon
    issues the two ZeRO-3 collectives only, and the naive gather-every-matrix Muon lands on the
    same weights bit for bit."""
    for res in run_ranks(_bench_measure, 2, backend="gloo"):
        assert res["same"]
        assert res["ops"] == {"owned": 2, "gather": 3}
        assert res["sent"] == res["predicted"]
        assert res["sent"]["owned"] < res["sent"]["gather"]
