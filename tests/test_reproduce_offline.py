"""fig7, fig8, fig9 and fig12 right: offline JCTs from hand-built run folders with known answers."""
import json

import pytest

from testbed.reproduce import module, reproduce_id
from testbed.reproduce.fig12 import ladder_configs
from tests.reproduce_helpers import HEADLINE_KEYS, is_valid_png, runs_for_plan

QUIET = dict(command="test", run_id="x", progress=lambda m: None)


def summary(out):
    return json.loads((out / "summary.json").read_text())


def heads(s):
    return {h["name"]: h for h in s["headline"]}


def check_interface(out, s, fig_id):
    assert s["id"] == fig_id
    assert s["pngs"] and all(is_valid_png(out / p) for p in s["pngs"])
    for h in s["headline"]:
        assert set(h) == HEADLINE_KEYS
    assert "Produced by `test`" in (out / "report.md").read_text()


# ---------------------------------------------------------------------------------------- fig7

FIG7_JCT = {"basic": 100.0, "dualpath": 50.0, "oracle": 40.0}


def fig7_jct(cfg, mode):
    return FIG7_JCT[mode] * cfg.params["agents"] / 4


def test_fig7_speedups_from_the_runs(tmp_path, monkeypatch):
    from testbed.reproduce import paper_rows
    monkeypatch.setattr(module("fig7"), "PROJECTION_AGENTS", (2, 3))  # the simulated projection, small
    monkeypatch.setattr(paper_rows, "AGENTS_PER_PE_NODE", {True: (1,), False: (1,)})  # the paper's grid, small
    plan = module("fig7").plan(True)
    runs_for_plan(tmp_path / "runs", plan, fig7_jct, bound=lambda c: 2.0)
    out, res = reproduce_id("fig7", quick=True, out_root=tmp_path / "out", run_folders=[tmp_path / "runs"], **QUIET)
    s = summary(out)
    check_interface(out, s, "fig7")
    assert s["faithful"] is True and s["complete"] is True
    assert s["pngs"] == ["fig7_64K.png", "fig7_panels.png"]
    tb = [c for c in s["cells"] if c["source"] == "testbed"]
    assert len(tb) == 2 and all(c["model"] == "Qwen2.5-32B" and c["maxlen"] == "64K" for c in tb)
    for c in tb:
        assert c["speedup"] == pytest.approx(2.0) and c["dualpath_over_oracle"] == pytest.approx(1.25)
        assert c["jct_s"]["basic"] == pytest.approx(25.0 * c["agents"])
    h = heads(s)["MaxLen 64K, 32 agents: DualPath speed-up over Basic (x)"]
    assert {k: h[k] for k in ("testbed", "paper", "bound")} == {"testbed": 2.0, "paper": 1.78, "bound": 2.0}
    assert heads(s)["MaxLen 64K, 4 agents: DualPath speed-up over Basic (x)"]["paper"] is None
    pj = s["projection"]  # simulated at full turn counts, apart from the testbed's headline rows
    assert [c["agents"] for c in pj["cells"]] == [2, 3] and all(c["turns_scale"] == 1.0 for c in pj["cells"])
    for c in pj["cells"]:
        assert c["speedup"] == pytest.approx(c["jct_s"]["basic"] / c["jct_s"]["dualpath"]) and c["dilation"] > 1
    # the simulator on the testbed's own largest cell, beside the testbed's numbers from the run
    assert pj["check"]["agents"] == 32 and pj["check"]["turns_scale"] == 4.0
    assert pj["check"]["testbed"]["jct_s"] == {"basic": 800.0, "dualpath": 400.0, "oracle": 320.0}
    assert pj["check"]["sim"]["speedup"] > 1
    assert "## Projection: MaxLen 64K at its full turn counts, simulated" in (out / "report.md").read_text()
    # every one of the paper's nine panels has a cell, and every simulated one says so
    sim = [c for c in s["cells"] if c["source"] == "simulated"]
    assert {(c["model"], c["maxlen"]) for c in sim} == {(m, x) for m in ("DS 660B", "DS 27B", "Qwen2.5-32B")
                                                          for x in ("32K", "48K", "64K")}
    for c in sim:
        assert c["faithful"] is None and c["agents"] == (2 if c["model"] == "DS 660B" else 1)
        assert c["cluster"] == {"DS 660B": "2P4D", "DS 27B": "1P1D", "Qwen2.5-32B": "1P2D"}[c["model"]]
        assert (c["speedup"] is None) == (c["failed"] > 0)
        if c["speedup"] is not None:
            assert c["speedup"] == pytest.approx(c["jct_s"]["basic"] / c["jct_s"]["dualpath"])
    assert s["sim_validation"]["mean_jct_err"] is not None
    assert "## Every panel: the paper's models on the paper's clusters, simulated" in (out / "report.md").read_text()


def test_fig7_unfaithful_when_one_run_is(tmp_path, monkeypatch):
    monkeypatch.setattr(module("fig7"), "CALIBRATION", tmp_path / "none.json")  # no projection
    monkeypatch.setattr(module("fig7"), "PAPER_GRID", False)  # nor the paper's simulated panels
    plan = module("fig7").plan(True)
    runs_for_plan(tmp_path / "runs", plan, fig7_jct, unfaithful={plan.configs[0].key})
    out, res = reproduce_id("fig7", quick=True, out_root=tmp_path / "out", run_folders=[tmp_path / "runs"], **QUIET)
    s = summary(out)
    assert s["faithful"] is False
    assert "NOT FAITHFUL" in (out / "report.md").read_text() and "overran" in (out / "report.md").read_text()


def test_fig7_missing_runs_are_reported(tmp_path, monkeypatch):
    monkeypatch.setattr(module("fig7"), "CALIBRATION", tmp_path / "none.json")  # no projection
    monkeypatch.setattr(module("fig7"), "PAPER_GRID", False)  # nor the paper's simulated panels
    plan = module("fig7").plan(True)
    plan.configs = plan.configs[:1]
    runs_for_plan(tmp_path / "runs", plan, fig7_jct)
    out, res = reproduce_id("fig7", quick=True, out_root=tmp_path / "out", run_folders=[tmp_path / "runs"], **QUIET)
    s = summary(out)
    assert s["complete"] is False and list(s["missing"]) == ["fig7/64K/agents=32"]
    assert len(s["cells"]) == 1


# ---------------------------------------------------------------------------------------- fig8

# Storage NICs reading: basic reads on P nodes, dualpath on P + D; JCT = 120 / readers.
READERS = {("1P1D", "basic"): 1, ("1P1D", "dualpath"): 2, ("1P2D", "basic"): 1, ("1P2D", "dualpath"): 3,
           ("2P1D", "basic"): 2, ("2P1D", "dualpath"): 3}


def fig8_jct(cfg, mode):
    return 120.0 / READERS[(cfg.params["pd"], mode)]


def test_fig8_equal_bandwidth_pairs(tmp_path):
    plan = module("fig8").plan(True)
    runs_for_plan(tmp_path / "runs", plan, fig8_jct)
    out, res = reproduce_id("fig8", quick=True, out_root=tmp_path / "out", run_folders=[tmp_path / "runs"], **QUIET)
    s = summary(out)
    check_interface(out, s, "fig8")
    assert s["pngs"] == ["fig8_jct.png", "fig8_speedup.png"] and s["faithful"] is True
    eq = s["equalities"]
    assert eq["basic_1p1d_over_basic_1p2d"] == pytest.approx(1.0)
    assert eq["dualpath_1p1d_over_basic_2p1d"] == pytest.approx(1.0)
    assert eq["dualpath_2p1d_over_dualpath_1p2d"] == pytest.approx(1.0)
    sp = {c["pd"]: c for c in s["configs"]}
    assert sp["1P2D"]["speedup"] == pytest.approx(3.0) and sp["2P1D"]["speedup"] == pytest.approx(1.5)
    # no speedup_bound in these summaries: the bound falls back to (P+D)/P from the topology
    assert sp["1P2D"]["bound"] == pytest.approx(3.0) and sp["2P1D"]["bound"] == pytest.approx(1.5)
    assert heads(s)["mean DualPath speed-up over the P/D ratios (x)"]["testbed"] == pytest.approx((2 + 3 + 1.5) / 3, rel=1e-3)


def test_fig8_common_storage_nic(tmp_path):
    """1p1d-io runs with the other two's storage NIC ratio."""
    cfg = {c.params["pd"]: c for c in module("fig8").plan(False).configs}
    rates = {pd: c.topology_obj().snic_bps for pd, c in cfg.items()}
    assert len(set(rates.values())) == 1
    assert cfg["1P1D"].topology_obj().name != "1p1d-io"  # the override shows in the name


def test_fig8_unfaithful_when_one_run_is(tmp_path):
    plan = module("fig8").plan(True)
    runs_for_plan(tmp_path / "runs", plan, fig8_jct, unfaithful={"fig8/2P1D"})
    out, _ = reproduce_id("fig8", quick=True, out_root=tmp_path / "out", run_folders=[tmp_path / "runs"], **QUIET)
    assert summary(out)["faithful"] is False


# ---------------------------------------------------------------------------------------- fig9


def fig9_jct(cfg, mode):
    s = cfg.params["scale"]
    # Basic approaches DualPath as the scale grows: speed-up 2 at x1, 1.25 at x4
    return {"basic": 100.0 if s == 1 else 50.0, "dualpath": 50.0 if s == 1 else 40.0, "oracle": 30.0}[mode]


def test_fig9_speedups_and_their_trend(tmp_path, monkeypatch):
    monkeypatch.setattr(module("fig9"), "PROJECTION_AGENTS", 2)  # the simulated projection, small
    plan = module("fig9").plan(True)
    runs_for_plan(tmp_path / "runs", plan, fig9_jct)
    # the x1 configs of both sides are one run (one digest)
    assert len(list((tmp_path / "runs").iterdir())) == 3
    out, res = reproduce_id("fig9", quick=True, out_root=tmp_path / "out", run_folders=[tmp_path / "runs"], **QUIET)
    s = summary(out)
    check_interface(out, s, "fig9")
    assert s["pngs"] == ["fig9_append.png", "fig9_gen.png"] and s["complete"] is True
    h = heads(s)
    assert h["append x1: DualPath speed-up over Basic (x)"]["testbed"] == pytest.approx(2.0)
    assert h["append x1: DualPath speed-up over Basic (x)"]["paper"] == 1.99
    assert h["append x4: DualPath speed-up over Basic (x)"]["testbed"] == pytest.approx(1.25)
    assert h["append x4: DualPath speed-up over Basic (x)"]["paper"] == 1.82
    assert s["speedup_change"] == {"append": pytest.approx(-0.75), "gen": pytest.approx(-0.75)}
    pj = s["projection"]  # simulated, apart from the testbed's headline rows
    assert pj["model"] == "deepseek-v3" and pj["agents"] == 2 and pj["append"][0] == pj["gen"][0]
    for p in pj["append"] + pj["gen"]:
        assert p["speedup"] == pytest.approx(p["jct_s"]["basic"] / p["jct_s"]["dualpath"]) and p["dilation"] > 20
    assert "## Projection: the paper's model, simulated" in (out / "report.md").read_text()


@pytest.mark.parametrize("quick", [True, False])
def test_fig9_workloads_reach_maxlen_so_larger_appends_end_trajectories_sooner(quick):
    """The paper's mechanism: with larger appends a trajectory reaches MaxLen in fewer turns, so
    each turn computes more per byte it reads back. The demo workload (10 turns) hardly ever
    reaches MaxLen, and its speed-up rose with the appends instead of falling."""
    from dataclasses import replace

    from dualpath.workload.trajectories import generate_lengths

    def turns(workload):
        return sum(len(t) for t in generate_lengths(workload.config()))

    cfgs = {c.key: c for c in module("fig9").plan(quick).configs}
    x1, x4 = cfgs["fig9/appendx1"].workload, cfgs["fig9/appendx4"].workload
    assert turns(x4) < 0.6 * turns(x1)
    demo = replace(x1, preset="demo", scale=1.0)
    assert turns(replace(demo, append_scale=4.0)) > 0.95 * turns(demo)  # 1 % of its turns cut


@pytest.mark.parametrize("fig", ["fig7", "fig9"])
def test_without_the_calibration_a_figure_has_no_projection(tmp_path, monkeypatch, fig):
    monkeypatch.setattr(module(fig), "CALIBRATION", tmp_path / "none.json")
    if fig == "fig7":
        monkeypatch.setattr(module(fig), "PAPER_GRID", False)
    runs_for_plan(tmp_path / "runs", module(fig).plan(True), {"fig7": fig7_jct, "fig9": fig9_jct}[fig])
    out, _ = reproduce_id(fig, quick=True, out_root=tmp_path / "out", run_folders=[tmp_path / "runs"], **QUIET)
    assert summary(out)["projection"] is None and "Projection" not in (out / "report.md").read_text()


def test_fig9_unfaithful_when_one_run_is(tmp_path, monkeypatch):
    monkeypatch.setattr(module("fig9"), "PROJECTION_AGENTS", 2)
    plan = module("fig9").plan(True)
    runs_for_plan(tmp_path / "runs", plan, fig9_jct, unfaithful={plan.configs[-1].key})  # gen's largest scale
    out, _ = reproduce_id("fig9", quick=True, out_root=tmp_path / "out", run_folders=[tmp_path / "runs"], **QUIET)
    assert summary(out)["faithful"] is False


# ---------------------------------------------------------------------------------------- fig12 right

LADDER_JCT = {"basic": 100.0, "layerwise": 80.0, "dualpath-rr": 60.0, "dualpath": 55.0, "oracle": 50.0}


def test_fig12_right_ladder_reductions(tmp_path):
    class P:  # only the ladder's runs; the online part has none (no online runner)
        configs = ladder_configs(True)

    runs_for_plan(tmp_path / "runs", P, lambda c, m: LADDER_JCT[m], bound=lambda c: 2.0)
    out, res = reproduce_id("fig12", quick=True, out_root=tmp_path / "out", run_folders=[tmp_path / "runs"], **QUIET)
    s = summary(out)
    check_interface(out, s, "fig12")
    assert s["pngs"] == ["fig12_right.png"]  # no left panel without online runs
    assert s["complete"] is False and all(k.startswith(("online/", "fig12/hbm/")) for k in s["missing"])
    assert s["faithful"] is True  # every run used was faithful
    h = heads(s)
    r = h["right: +Layerwise mean JCT reduction vs Basic (share) (Qwen2.5-32B ladder, HBM does not bind)"]
    assert r["testbed"] == pytest.approx(0.2) and r["paper"] == 0.1721 and r["bound"] == pytest.approx(0.5)
    assert h["right, where HBM binds (DS 660B, 1p1d-hbm): +Layerwise mean JCT reduction vs Basic (share)"]["testbed"] is None
    assert h["right: DualPath mean JCT reduction vs Basic (share)"]["testbed"] == pytest.approx(0.45)
    assert h["right: +DualPath (round-robin) mean JCT reduction vs Basic (share)"]["paper"] == 0.3819
    assert "Poisson arrivals" in (out / "report.md").read_text()  # the missing online runs are named


def test_fig12s_first_step_where_hbm_binds_is_its_own_headline_with_the_share_of_full_passes(tmp_path):
    """The +Layerwise step on 1p1d-hbm comes from those runs alone (not the Qwen ladder's), and the
    report says how many of each mode's passes HBM filled."""
    from testbed.reproduce.fig12 import hbm_configs

    class P:
        configs = ladder_configs(True) + hbm_configs(True)

    def passes(full: int, n: int = 10) -> list[dict]:
        return [{"n": 4, "batch_tokens": 8000, "hbm_peak_bytes": 4e8, "hbm_limited": i < full} for i in range(n)]

    runs_for_plan(tmp_path / "runs", P, lambda c, m: {"basic": 100.0, "layerwise": 94.0}[m]
                  if c.params.get("hbm") else LADDER_JCT[m], bound=lambda c: 2.0)
    hbm_dir = tmp_path / "runs" / hbm_configs(True)[0].folder()
    rows = [{"mode": m, **r} for m, full in (("basic", 6), ("layerwise", 0)) for r in passes(full)]  # 6 of Basic's 10 full
    (hbm_dir / "passes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out, _ = reproduce_id("fig12", quick=True, out_root=tmp_path / "out", run_folders=[tmp_path / "runs"], **QUIET)
    s = summary(out)
    h = heads(s)
    assert h["right, where HBM binds (DS 660B, 1p1d-hbm): +Layerwise mean JCT reduction vs Basic (share)"]["testbed"] \
        == pytest.approx(0.06)
    assert h["right: +Layerwise mean JCT reduction vs Basic (share) (Qwen2.5-32B ladder, HBM does not bind)"]["testbed"] \
        == pytest.approx(0.2)
    assert s["hbm_full_share"] == {"basic": pytest.approx(0.6), "layerwise": 0.0}
    assert "Basic 60%, +Layerwise 0% of prefill passes were HBM-full" in (out / "report.md").read_text()


def test_fig12_right_unfaithful_when_the_ladder_is(tmp_path):
    class P:
        configs = ladder_configs(True)

    runs_for_plan(tmp_path / "runs", P, lambda c, m: LADDER_JCT[m], unfaithful={P.configs[0].key})
    out, _ = reproduce_id("fig12", quick=True, out_root=tmp_path / "out", run_folders=[tmp_path / "runs"], **QUIET)
    assert summary(out)["faithful"] is False


def test_fig12s_mean_reduction_is_bounded_by_the_mean_of_each_runs_own_bound():
    from testbed.reproduce.fig12 import reduction_bound

    # 12 agents: a chain bound of 1.25 (reduction at most 0.2); 24 agents: (P+D)/P = 2 (0.5)
    assert reduction_bound([{"bound": 1.25}, {"bound": 2.0}]) == pytest.approx(0.35)
    assert reduction_bound([{"bound": 2.0}, {"bound": None}]) is None
