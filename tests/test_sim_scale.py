"""table3 and fig15: the simulated scale runs (testbed.reproduce.scale) on the paper's clusters,
at one agent per prefill node so that the test runs in seconds."""
from __future__ import annotations

import pytest

from testbed.reproduce import fig15, scale, table3
from testbed.sim.drive import trajectories
from dualpath.workload import demo_workload


def test_replicas_keep_the_lengths_under_new_ids():
    base = trajectories(demo_workload(n_trajectories=3), 1.0)
    rep = scale.replicate(base, 4)
    assert len(rep) == 12 and len({t.id for t in rep}) == 12
    assert [t.turns for t in rep[6:9]] == [t.turns for t in base]


def test_stagger_starts_every_copy_apart_inside_the_window_and_repeats_per_seed():
    rep = scale.replicate(trajectories(demo_workload(n_trajectories=3), 1.0), 4)
    st = scale.stagger(rep, 0.02, seed=5)
    starts = [t.arrival_s for t in st]
    assert len(set(starts)) == len(st) and all(0 <= a < 0.02 for a in starts)
    assert [t.turns for t in st] == [t.turns for t in rep]
    assert starts == [t.arrival_s for t in scale.stagger(rep, 0.02, seed=5)]
    assert starts[:3] == [t.arrival_s for t in scale.stagger(rep[:3], 0.02, seed=5)]  # a cluster's first agents alike


def test_offline_scale_runs_do_not_start_their_copies_in_lockstep(tiny):
    res, _ = scale.run_one("48p96d", True, progress=lambda s: None)
    first = [r.t_arrive for r in res.records if r.turn == 0]
    assert len(first) == 48 and len(set(first)) == 48
    assert max(first) < scale.START_STAGGER_S


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setattr(scale, "AGENTS_PER_PE_NODE", 1)


def test_table3_projects_near_linear_scaling_and_the_scheduler_cost(tiny, tmp_path):
    r = table3.reproduce({}, tmp_path, quick=True)
    d = r.data
    assert d["offline"]["48p96d"]["agents"] == 24 * d["offline"]["2p4d-paper"]["agents"] == 48
    assert d["offline"]["48p96d"]["requests"] == 24 * d["offline"]["2p4d-paper"]["requests"]
    assert d["scaling_within_tolerance"], d["jct_ratio"]
    assert d["online"]["44p88d"]["aps"] == pytest.approx(22 * d["online"]["2p4d-paper"]["aps"])
    assert 0 < d["scheduler_cores_max"]
    assert r.no_runs_needed and r.faithful is None and r.is_result  # no testbed run: nothing to be FAITHFUL about
    s = r.summary("test", True, None)
    assert s["faithful"] is None and all(h["testbed"] is None and h["simulated"] is not None for h in s["headline"])


def test_fig15_series_count_every_prompt_token(tiny, tmp_path):
    res, _ = scale.run_one("2p4d-paper", True, progress=lambda s: None)
    s = fig15.series(res)
    w = s["t_s"][1] - s["t_s"][0]
    assert len(s["t_s"]) == fig15.BINS
    assert sum(s["prompt_tps"]) * w == pytest.approx(sum(r.n_prompt for r in res.records), rel=1e-9)
    assert all(v is None or v > 0 for v in s["ttft_mean_s"])
    r = fig15.reproduce({}, tmp_path, quick=True)
    assert (tmp_path / "fig15.png").exists()
    v = fig15.headline_values(r.data["series"])  # the headline is the plotted series'
    assert [h.testbed for h in r.headline[:3]] == [v["phase_tps"], v["first_ttft"], v["later_ttft"]]
    assert v["first_ttft"] > 0 and r.data["summary"]["requests_per_wall_s"] > 0
    heads = r.summary("test", True, None)["headline"]
    assert all(h["testbed"] is None and "simulated" in h for h in heads) and heads[1]["simulated"] > 0
    assert "(simulated)" in "\n".join(r.report_lines("test"))


def test_fig15_headline_reads_the_series_it_plots():
    """A series with a known answer: a burst of prefill (bins 2-5, one of them dipping under half
    the peak but inside the phase), then a drain."""
    n = fig15.BINS
    tps = [10.0, 20.0, 100.0, 80.0, 40.0, 60.0, 30.0] + [1.0] * (n - 7)
    ttft = [9.0, None, 5.0, 12.0, 14.0, 20.0, 0.5] + [None] * (n - 7)
    s = {"t_s": list(range(n)), "prompt_tps": tps, "ttft_mean_s": ttft}
    assert fig15.loaded_bins(s) == [2, 3, 4, 5]
    assert fig15.headline_values(s) == {"phase_tps": 70.0, "phase_bins": 4, "first_ttft": 9.0, "later_ttft": 14.0}


def test_paper_agents_join_their_trajectories_with_the_context_before_stored():
    full, _ = scale.paper_agents(40, 10 ** 6, 1.0, seed=3)
    cut, wcfg = scale.paper_agents(40, 2, 1.0, seed=3)
    assert wcfg.max_len == 64 * 1024 and len(cut) == 40
    assert all(1 <= len(c.turns) <= 2 and c.turns == f.turns[:len(c.turns)] for c, f in zip(cut, full))
    assert any(c.system_prompt_len > wcfg.system_prompt_len for c in cut)  # some joined past their first turn
    assert cut == scale.paper_agents(40, 2, 1.0, seed=3)[0]
