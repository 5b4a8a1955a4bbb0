"""The benchmark runs and places every request it times (no timing assertions: it prints)."""
from __future__ import annotations

import pytest

from testbed.calibrate.benches.scheduler import bench_decision_cost, main


@pytest.mark.parametrize("policy", ["shorter", "split"])
def test_bench_places_requests(policy):
    r = bench_decision_cost(n_engines=48, n_requests=64, batch=8, path_policy=policy)
    assert (r["pe_groups"], r["de_groups"]) == (2, 4)
    assert r["requests_placed"] > 0 and r["rounds"] > 0
    assert r["median_us"] > 0 and r["ratio_to_budget"] == r["median_us"] / r["budget_us"]
    with pytest.raises(ValueError):
        bench_decision_cost(n_engines=50)


def test_bench_cli_prints_median_and_ratio(capsys):
    assert main(["--engines", "48", "--requests", "32", "--batch", "8"]) == 0
    out = capsys.readouterr().out
    assert "median" in out and "budget" in out
