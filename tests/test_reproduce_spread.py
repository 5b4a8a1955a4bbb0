"""The intervals behind JCT headlines: a bootstrap over agents, on hand-built runs with known answers."""
import pytest

from testbed.measure.runs import load_run
from testbed.reproduce.spread import (difference_draws, jct_draws, mean_draws, ratio_draws, sample_draws, sample_ratio_draws,
                                      speedup_draws)
from tests.reproduce_helpers import RunFolder

K = 2.0  # the hand-built runs' dilation: records are in testbed s, JCTs in emulated s


def agents(finish_s: list[float], turns: int = 2) -> list[dict]:
    """Records of agents whose last turn ends at finish_s (emulated s), every turn arriving at 0."""
    return [{"trajectory": a, "turn": t, "t_arrive": 0.0, "t_done": f * K * (t + 1) / turns, "error": None}
            for a, f in enumerate(finish_s) for t in range(turns)]


def run_of(tmp_path, name: str, modes: dict[str, list[float]]):
    rf = RunFolder(tmp_path / name, dilation=K)
    for m, fin in modes.items():
        rf.mode(m, jct_s=max(fin), records=agents(fin))
    return load_run(rf.write())


def test_a_speed_up_that_every_agent_shares_has_no_spread(tmp_path):
    fin = [float(i) for i in range(1, 31)]
    r = run_of(tmp_path, "r", {"basic": [2 * f for f in fin], "dualpath": fin})
    e = speedup_draws(r).estimate()
    assert e.value == pytest.approx(2.0) and e.n == 30 and e.ci95 == (pytest.approx(2.0), pytest.approx(2.0))
    assert "paired" in e.method


def test_a_jct_interval_says_how_much_it_rests_on_the_last_agents(tmp_path):
    # 29 agents end at 10 s and one at 20 s: a resample leaves the straggler out with probability
    # (29/30)^30 = 0.36, so the interval reaches down to 10 and up to the run's own 20
    r = run_of(tmp_path, "r", {"basic": [10.0] * 29 + [20.0]})
    e = jct_draws(r, "basic").estimate()
    assert e.value == 20.0 and e.n == 30 and e.ci95 == (pytest.approx(10.0), pytest.approx(20.0))
    # every agent at 10 s but the straggler shared by both modes: the ratio is 1 in every resample
    r2 = run_of(tmp_path, "r2", {"basic": [10.0] * 29 + [20.0], "dualpath": [5.0] * 29 + [20.0]})
    lo, hi = speedup_draws(r2).estimate().ci95
    assert (lo, hi) == (pytest.approx(1.0), pytest.approx(2.0))


def test_runs_with_different_agents_are_resampled_apart(tmp_path):
    a = run_of(tmp_path, "a", {"basic": [4.0] * 10})
    b = run_of(tmp_path, "b", {"basic": [2.0] * 20})
    d = ratio_draws((a, "basic"), (b, "basic"))
    assert d.value == pytest.approx(2.0) and "apart" in d.method and d.n == 10


def test_means_and_differences_carry_their_replicates(tmp_path):
    r1 = run_of(tmp_path, "r1", {"basic": [3.0] * 20, "dualpath": [1.0] * 20})
    r2 = run_of(tmp_path, "r2", {"basic": [2.0] * 20, "dualpath": [1.0] * 20})
    m = mean_draws([speedup_draws(r1), speedup_draws(r2)]).estimate()
    assert m.value == pytest.approx(2.5) and m.ci95 == (pytest.approx(2.5), pytest.approx(2.5))
    d = difference_draws(speedup_draws(r2), speedup_draws(r1)).estimate()
    assert d.value == pytest.approx(-1.0) and d.ci95 == (pytest.approx(-1.0), pytest.approx(-1.0))


def test_a_run_without_records_keeps_its_value_and_claims_no_interval(tmp_path):
    rf = RunFolder(tmp_path / "bare").mode("basic", jct_s=6.0).mode("dualpath", jct_s=3.0)
    e = speedup_draws(load_run(rf.write())).estimate()
    assert e.value == pytest.approx(2.0) and e.ci95 is None


def test_a_ratio_of_means_over_requests():
    e = sample_ratio_draws([2.0, 4.0] * 50, [1.0] * 40, "requests").estimate()
    lo, hi = e.ci95
    assert e.value == pytest.approx(3.0) and 2.7 < lo < 3.0 < hi < 3.3 and e.n == 40 and "each apart" in e.method
    assert sample_ratio_draws([], [1.0], "requests").value is None


def test_a_p99_interval_over_collectives():
    xs = [1.0] * 990 + [10.0] * 10  # the p99 sits on the edge of the slow tail
    e = sample_draws(xs, "collectives", q=99).estimate()
    assert e.value == pytest.approx(float(__import__("numpy").percentile(xs, 99))) and e.n == 1000
    assert e.ci95[0] == pytest.approx(1.0) and e.ci95[1] > 5.0 and "p99" in e.method
    r = sample_ratio_draws([2.0] * 500, [1.0] * 500, "collectives", q=99).estimate()
    assert r.value == pytest.approx(2.0) and r.ci95 == (pytest.approx(2.0), pytest.approx(2.0))


def test_fig8_headlines_and_plot_rows_carry_the_same_interval(tmp_path):
    """fig8 on runs whose agents all speed up by the P/D's factor except one straggler that
    finishes last in both modes: each speed-up's interval runs from 1 (the straggler drawn)
    to the factor (left out), and the row the PNG draws carries the headline's interval."""
    from testbed.reproduce import module, reproduce_id
    from tests.reproduce_helpers import plan_json

    factor = {"1P1D": 2.0, "1P2D": 3.0, "2P1D": 1.5}
    for cfg in module("fig8").plan(True).configs:
        f = factor[cfg.params["pd"]]
        rf = RunFolder(tmp_path / "runs" / cfg.folder(), dilation=K, topology=cfg.topology)
        basic = [30.0] * 29 + [60.0]
        dual = [30.0 / f] * 29 + [60.0]
        rf.mode("basic", jct_s=60.0, records=agents(basic)).mode("dualpath", jct_s=60.0, records=agents(dual))
        rf.write(plan=plan_json(cfg))
    out, _ = reproduce_id("fig8", quick=True, out_root=tmp_path / "out", run_folders=[tmp_path / "runs"],
                          command="test", run_id="x", progress=lambda m: None)
    import json

    s = json.loads((out / "summary.json").read_text())
    heads = {h["name"]: h for h in s["headline"]}
    rows = {c["pd"]: c for c in s["configs"]}
    for pd, f in factor.items():
        h = heads[f"{pd}: DualPath speed-up over Basic (x)"]
        assert h["testbed"] == pytest.approx(1.0) and h["n"] == 30 and "paired" in h["ci_method"]
        assert h["ci95"] == [pytest.approx(1.0), pytest.approx(f)] and rows[pd]["speedup_ci95"] == pytest.approx(h["ci95"])
    mean = heads["mean DualPath speed-up over the P/D ratios (x)"]
    assert mean["testbed"] == pytest.approx(1.0) and mean["ci95"][1] == pytest.approx(sum(factor.values()) / 3, rel=0.01)


def test_a_statistic_of_sums_over_units_gets_its_interval_and_keeps_the_runs_own_value():
    from testbed.reproduce.spread import sums_draws
    hit_rate = lambda s: s[..., 0] / s[..., 1]  # noqa: E731
    # every unit hits half its tokens: every resample says 0.5, scaled to the run's own 0.48
    same = sums_draws([(50, 100)] * 40, hit_rate, 0.48, "requests").estimate()
    assert same.value == 0.48 and same.n == 40 and same.ci95 == (pytest.approx(0.48), pytest.approx(0.48))
    # half hit everything, half nothing: the interval spans the binomial spread around 0.5
    mixed = sums_draws([(100, 100)] * 50 + [(0, 100)] * 50, hit_rate, 0.5, "requests").estimate()
    lo, hi = mixed.ci95
    assert 0.38 < lo < 0.45 and 0.55 < hi < 0.62
    # a balance over NICs: one NIC takes every byte of a third of the requests
    bal = sums_draws([(1, 0)] * 20 + [(0, 1)] * 10, lambda s: s.max(axis=-1) / s.mean(axis=-1), 4 / 3, "requests")
    e = bal.estimate()
    assert e.value == pytest.approx(4 / 3) and e.ci95[0] < 4 / 3 < e.ci95[1]
    assert sums_draws([(1, 2)], hit_rate, 0.5, "requests").estimate().ci95 is None  # one unit: nothing to resample


def test_mooncake_trace_secondary_rows_are_bootstrapped_over_the_runs_requests(tmp_path):
    from testbed.reproduce import mooncake_trace as mt
    rf = RunFolder(tmp_path / "run")
    for m in mt.MODES:
        recs = [{"trajectory": i, "turn": 0, "t_arrive": 0.0, "t_done": 1.0, "ttft_s": 0.1 * (i + 1), "n_hit": i % 2,
                 "n_prompt": 1, "interfaces": {"p0/snic/rx": 100 * (i % 3 == 0), "d0/snic/rx": 100 * (i % 3 != 0)}}
                for i in range(30)]
        rf.mode(m, records=recs + [{"trajectory": -1, "turn": 0, "ttft_s": 99.0, "n_hit": 0, "n_prompt": 1}])
    r = load_run(rf.write())
    p50 = mt.ttft_p50_draws(r, "dualpath").estimate()
    assert p50.value == pytest.approx(1.55) and p50.n == 30  # the warm-up's 99 s is not a request
    assert p50.ci95[0] < 1.55 < p50.ci95[1]
    hit = mt.hit_rate_draws(r, 0.5).estimate()
    assert hit.n == 60 and hit.ci95[0] < 0.5 < hit.ci95[1]
    snic = mt.snic_balance_draws(r, "dualpath", 4 / 3).estimate()  # the d0 SNIC takes 20 of 30 requests
    assert snic.value == pytest.approx(4 / 3) and snic.n == 30 and snic.ci95[0] < 4 / 3 < snic.ci95[1]


def test_mooncake_trace_at_its_own_scale_runs_on_the_papers_model_of_that_cluster():
    """Qwen2.5-32B's weights leave an H800 24,689 tokens of KV: the trace's 120K-token prompts
    could never decode there, so the trace-scale view is DS 660B on the paper's 2P4D, whose
    budget holds them (a regression: this view refused the trace once HBM became a limit)."""
    from testbed.reproduce import mooncake_trace as mt
    topo = mt.sim_topology()
    assert topo.spec.target.model == "deepseek-v3.2" and topo.spec.prefill_nodes == 2 and topo.spec.decode_nodes == 4
    s = mt.simulate(mt.trace_spec(True, own_scale=True), topo, "target", mt._uncalibrated().without_host())
    assert set(s["modes"]) == set(mt.MODES)
    assert all(m["errors"] == 0 and m["requests"] == s["trace"]["requests"] for m in s["modes"].values())


def test_a_mode_that_lost_requests_is_no_result_even_when_its_time_was_faithful(tmp_path):
    rf = RunFolder(tmp_path / "run")
    rf.mode("basic").mode("dualpath")
    rf.summary["modes"]["dualpath"].update(errors=3, requests=40, first_error={"request": "x", "error": "no engine"})
    r = load_run(rf.write())
    assert r.faithful(["basic"]) and not r.faithful()
    assert r.unfaithful() == {"dualpath": ["3 of 40 requests failed (first: no engine)"]}


def test_an_interval_that_excludes_its_own_value_is_not_shown():
    import numpy as np

    from testbed.reproduce.spread import Draws, sums_draws

    # two NICs; requests in mirrored pairs, so the run is balanced (1.0) and a resample almost never is
    xs = np.random.default_rng(1).uniform(0, 200, 30)
    units = [[x, 200 - x] for x in xs] + [[200 - x, x] for x in xs]
    e = sums_draws(units, lambda s: s.max(axis=-1) / s.mean(axis=-1), 1.0, "requests").estimate()
    assert e.value == 1.0 and e.ci95 is None and e.method.startswith("no interval: the run's value lies outside")
    inside = Draws(2.0, np.linspace(1.0, 3.0, 101), 101, "m").estimate()
    assert inside.ci95 == (pytest.approx(1.05), pytest.approx(2.95)) and inside.method == "m"


def test_a_headline_without_an_interval_says_why_in_its_report_and_summary():
    from testbed.reproduce.common import Headline
    from testbed.reproduce.spread import Estimate

    h = Headline.of("SNIC max/avg", Estimate(1.007, 918, None, "no interval: the run's value lies outside it"))
    assert h.to_dict()["ci_method"].startswith("no interval") and h.to_dict()["ci95"] is None
    plain = Headline.of("x", Estimate(2.0, 1, None, "bootstrap over requests"))
    assert plain.to_dict()["ci_method"] is None  # one sample: nothing to say beyond n
