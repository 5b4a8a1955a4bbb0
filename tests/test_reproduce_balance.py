"""fig13 (storage NIC balance from links.jsonl) and fig14 (attention balance from passes.jsonl) on
hand-built time series with known ratios."""
import json

import pytest

from testbed.measure import plots

from testbed.reproduce import fig13, fig14, reproduce_id
from testbed.reproduce.common import MIN_LOADED
from testbed.reproduce.spread import loaded_mean
from testbed.reproduce.fig13 import draw_windows, mark_loaded, snic_series
from testbed.reproduce.fig14 import WINDOW_S, attention_series, attention_windows
from tests.reproduce_helpers import RunFolder, is_valid_png, plan_json

QUIET = dict(command="test", run_id="x", progress=lambda m: None)
K = 2.0
NICS = ("dpt-p0/snic", "dpt-p1/snic", "dpt-d0/snic")
RATE_BPS = 8_000  # each storage NIC: 1,000 bytes per testbed second


def links(rates, seconds=40.0, tail=10.0, dt=0.25):
    """Samples of cumulative rx bytes: each NIC at rates[i] bytes per testbed s while loaded,
    then a tail at a tenth of that (the workload drains); other NICs carry noise."""
    out, cum = [], [0.0] * len(rates)
    t = 0.0
    while t <= seconds + tail + 1e-9:
        nics = {n: [int(c), 0] for n, c in zip(NICS, cum)}
        nics["dpt-p0e0/cnic"] = [int(t * 5e6), int(t * 1e6)]  # not a storage NIC: ignored
        out.append({"t": t, "cpu_busy": 0.3, "nics": nics})
        f = 1.0 if t < seconds else 0.1
        cum = [c + r * f * dt for c, r in zip(cum, rates)]
        t += dt
    return out


def test_snic_series_known_ratios():
    even = snic_series(links([1000, 1000, 1000]), dilation=K, window_s=1.0)
    skew = snic_series(links([2000, 500, 500]), dilation=K, window_s=1.0)
    assert even and all(w["max_over_avg"] == pytest.approx(1.0) for w in even)
    assert all(w["max_over_avg"] == pytest.approx(2.0) for w in skew)  # 2000 / mean(2000, 500, 500)
    w = even[3]  # 1 emulated s = 2 testbed s: 2,000 bytes per NIC
    assert w["t1"] - w["t0"] == pytest.approx(1.0) and w["bytes"]["dpt-p0/snic"] == pytest.approx(2000)
    assert set(w["bytes"]) == set(NICS)


def test_loaded_windows_leave_the_drain_out():
    ser = snic_series(links([1000, 1000, 1000]), dilation=K, window_s=1.0)
    cap = 3 * 1000 * K  # bytes per emulated second at the NICs' rate
    pts = mark_loaded(ser, cap, window_s=1.0)
    assert [p["loaded"] for p in pts] == [True] * 20 + [False] * (len(pts) - 20)  # 40 testbed s = 20 emulated s
    assert [p["loaded"] for p in mark_loaded(ser, None, window_s=1.0)] == [p["loaded"] for p in pts]  # busiest's
    assert not any(p["loaded"] for p in mark_loaded(ser, 10 * cap, window_s=1.0))  # never half that loaded: none


def balance_run(path, cfg, unfaithful=False, skew=(2000, 500, 500)):
    f = RunFolder(path, dilation=K, topology="2p1d-io")
    rates = {n: RATE_BPS for n in NICS}
    f.mode("dualpath-rr", snic_rates_bps=rates, links=links(list(skew)),
           passes=passes([1.0, 1.5, 1.0, 0.5], loaded_steps=6))
    f.mode("dualpath", faithful=not unfaithful, snic_rates_bps=rates, links=links([1000, 1000, 1000]),
           passes=passes([1.0, 1.0, 1.2, 0.8], loaded_steps=6))
    return f.write(plan=plan_json(cfg))


def fig13_runs(root, unfaithful=False):
    """One hand-built folder per run of fig13's quick plan (its seeds); the last seed less skewed."""
    cfgs = fig13.plan(True).configs
    for i, cfg in enumerate(cfgs):
        balance_run(root / f"r{i}", cfg, unfaithful, skew=(2000, 500, 500) if i < len(cfgs) - 1 else (1500, 750, 750))
    return root


def passes(att, loaded_steps, steps=10):
    """Each PE's k-th pass starts at 2k testbed s and lasts att[pe]; the first loaded_steps are loaded
    (after that the PEs' queues run dry and every pass is as short as 0.1)."""
    out = []
    for k in range(steps):
        for i, a in enumerate(att):
            out.append({"pe": f"dpt-p{i // 2}e{i % 2}", "t_start": 2.0 * k + 0.01 * i, "t_end": 2.0 * k + 1,
                        "n": 3, "loaded": k < loaded_steps, "attention_s": a if k < loaded_steps else 0.1 * (1 + i)})
    return out


def test_attention_series_pairs_kth_passes():
    ser = attention_series(passes([1.0, 1.0, 1.2, 0.8], loaded_steps=6), dilation=K)
    assert len(ser) == 10 and sum(s["loaded"] for s in ser) == 6
    assert ser[0]["max_over_avg"] == pytest.approx(1.2) and ser[0]["pes"] == 4
    assert ser[1]["t"] == pytest.approx((2.0 + 0.015) / K)
    assert ser[9]["max_over_avg"] == pytest.approx(0.4 / 0.25)  # unloaded tail: counted, not in the headline


def test_fig13_pools_its_seeds_and_its_headline_is_the_plotted_series(tmp_path):
    fig13_runs(tmp_path / "runs")
    out, res = reproduce_id("fig13", quick=True, out_root=tmp_path / "out", run_folders=[tmp_path / "runs"], **QUIET)
    s = json.loads((out / "summary.json").read_text())
    assert s["pngs"] == ["fig13.png"] and is_valid_png(out / "fig13.png") and s["faithful"] is True
    assert s["complete"] and s["is_result"] and len(s["runs"]) == fig13.QUICK_SEEDS == 3
    h = {x["name"]: x for x in s["headline"]}
    rr = h["+DualPath (round-robin): storage NIC max/avg, mean over the loaded windows"]
    dp = h["DualPath: storage NIC max/avg, mean over the loaded windows"]
    per_run = 20 / fig13.WINDOW_S  # 20 loaded emulated s per run
    assert s["loaded_windows"] == {"dualpath-rr": 3 * per_run, "dualpath": 3 * per_run}
    assert rr["testbed"] == pytest.approx((2.0 + 2.0 + 1.5) / 3, abs=1e-4) and rr["n"] == 3 * per_run and rr["paper"] == 1.53
    lo, hi = rr["ci95"]
    assert 1.5 <= lo < rr["testbed"] < hi <= 2.0 and rr["ci_method"].startswith("bootstrap")
    assert dp["testbed"] == pytest.approx(1.0) and dp["paper"] == 1.18
    for m, pts in s["series"].items():  # the headline is the mean of the loaded points the PNG draws
        loaded = [p["value"] for p in pts if p["loaded"]]
        assert h[f"{plots.label(m)}: storage NIC max/avg, mean over the loaded windows"]["testbed"] == \
            pytest.approx(sum(loaded) / len(loaded), abs=1e-4)
    report = (out / "report.md").read_text()
    assert "95 % interval" in report and "the paper's 1.53 is below" in report


def test_draw_windows_draws_exactly_the_points_the_headline_averages():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [{"t": 0.25 + 0.5 * i, "value": v, "loaded": i % 3 != 2, "run": i // 6} for i, v in
           enumerate([1.2, 1.4, 3.0, 1.0, 1.6, 9.0, 1.1, 1.3, 5.0, 1.5, 1.1, 7.0])]
    est = loaded_mean(pts)
    assert est.value == pytest.approx((1.2 + 1.4 + 1.0 + 1.6 + 1.1 + 1.3 + 1.5 + 1.1) / 8) and est.n == 8
    fig, ax = plt.subplots()
    draw_windows(ax, {"dualpath": pts})
    lines = [list(ln.get_ydata()) for ln in ax.lines]
    assert lines == [[p["value"] for p in pts if p["run"] == r] for r in (0, 1)]  # one line per seed
    dots = ax.collections[0].get_offsets()
    assert sorted(float(y) for _, y in dots) == sorted(p["value"] for p in pts if p["loaded"])
    plt.close(fig)


def test_too_few_loaded_windows_is_not_a_result(tmp_path):
    cfg = fig13.plan(True).configs[0]
    f = RunFolder(tmp_path / "runs" / "r", dilation=K, topology="2p1d-io")
    f.mode("dualpath", snic_rates_bps={n: RATE_BPS for n in NICS}, links=links([1000, 1000, 1000], seconds=8.0))
    f.write(plan=plan_json(cfg))
    out, res = reproduce_id("fig13", quick=True, out_root=tmp_path / "out", run_folders=[tmp_path / "runs"], **QUIET)
    s = json.loads((out / "summary.json").read_text())
    assert s["loaded_windows"]["dualpath"] == 8 < MIN_LOADED and s["is_result"] is False
    assert any("8 loaded windows, fewer than 20" in x for x in s["shortfalls"])
    assert "**Not a result.**" in (out / "report.md").read_text()


def busy_passes(att, loaded_windows, windows=10):
    """PE i's k-th pass fills emulated window k (testbed [2k, 2k+2) at K = 2) with attention att[i]
    while loaded; afterwards each pass lasts a tenth of its window (the queues ran dry)."""
    out = []
    for k in range(windows):
        for i, a in enumerate(att):
            loaded = k < loaded_windows
            out.append({"pe": f"dpt-p{i // 2}e{i % 2}", "t_start": 2.0 * k, "t_end": 2.0 * k + (2.0 if loaded else 0.2),
                        "n": 3, "loaded": loaded, "attention_s": a if loaded else 0.1 * (1 + i)})
    return out


def test_attention_windows_prorate_passes_and_mark_loaded_windows():
    win = attention_windows(busy_passes([1.0, 1.0, 1.2, 0.8], loaded_windows=6), dilation=K, window_s=1.0)
    assert len(win) == 10 and sum(w["loaded"] for w in win) == 6
    assert win[0]["max_over_avg"] == pytest.approx(1.2) and win[0]["min_busy_share"] == pytest.approx(1.0)
    assert not win[7]["loaded"] and win[7]["min_busy_share"] == pytest.approx(0.1)
    # a pass that straddles two windows gives each the share of its attention that overlaps it
    half = attention_windows([{"pe": "a", "t_start": 1.0, "t_end": 3.0, "attention_s": 0.8},
                              {"pe": "b", "t_start": 1.0, "t_end": 2.0, "attention_s": 0.4}], dilation=1.0, window_s=1.0)
    assert half[0]["attention"] == {"a": pytest.approx(0.4), "b": pytest.approx(0.4)}
    assert half[0]["loaded"] and half[0]["max_over_avg"] == pytest.approx(1.0)
    assert not half[1]["loaded"] and half[1]["max_over_avg"] == pytest.approx(2.0)  # only a: 0.4 vs mean 0.2


def balance_folders(root, unfaithful=False):
    """One hand-built folder per run of fig14's quick plan (its seeds)."""
    for i, cfg in enumerate(fig14.plan(True).configs):
        f = RunFolder(root / f"r{i}", dilation=K, topology="2p1d-io")
        f.mode("dualpath-rr", passes=busy_passes([1.0, 1.5, 1.0, 0.5], loaded_windows=6))
        f.mode("dualpath", faithful=not unfaithful, passes=busy_passes([1.0, 1.0, 1.2, 0.8], loaded_windows=6))
        f.write(plan=plan_json(cfg))
    return root


def test_fig14_from_its_run(tmp_path):
    balance_folders(tmp_path / "runs")
    out, res = reproduce_id("fig14", quick=True, out_root=tmp_path / "out", run_folders=[tmp_path / "runs"], **QUIET)
    s = json.loads((out / "summary.json").read_text())
    assert s["pngs"] == ["fig14.png"] and is_valid_png(out / "fig14.png") and s["faithful"] is True
    h = {x["name"]: x for x in s["headline"]}
    dp = h["DualPath: attention max/avg across PEs, mean over loaded windows"]
    assert dp["testbed"] == pytest.approx(1.2) and dp["paper"] == 1.06 and dp["bound"] == 1.0
    assert h["+DualPath (round-robin): attention max/avg across PEs, mean over loaded windows"]["testbed"] == \
        pytest.approx(1.5)
    assert dp["n"] == 3 * 6 / WINDOW_S == s["loaded_windows"]["dualpath"]  # 6 loaded emulated seconds per seed
    assert s["is_result"] and all(p["loaded"] == (p["t"] < 6) for p in s["series"]["dualpath"])
    assert s["modes"]["dualpath"]["loaded_share"] == pytest.approx(0.6)  # 6 loaded s of a 10 s JCT, per seed
    assert "60% of the runs' JCT." in (out / "report.md").read_text()
    step = h["DualPath: attention max/avg per k-th pass, mean over loaded steps (secondary)"]
    assert step["n"] and step["ci95"] is not None and step["ci95"][0] <= step["testbed"] <= step["ci95"][1]
    assert "loaded steps" in step["ci_method"]


def test_fig14_has_its_own_compute_loaded_run():
    from testbed.reproduce.fig14 import APPEND_SCALE

    cfg, sched = fig14.balance_config(True), fig13.scheduler_config(True)
    assert cfg.digest() != sched.digest() and cfg.workload.append_scale == APPEND_SCALE > 1
    assert cfg.topology == sched.topology and cfg.topology_overrides["scale"] < sched.topology_overrides["scale"]


@pytest.mark.parametrize("fig", ["fig13", "fig14"])
def test_unfaithful_run_makes_the_figure_unfaithful(tmp_path, fig):
    (fig13_runs if fig == "fig13" else balance_folders)(tmp_path / "runs", unfaithful=True)
    out, _ = reproduce_id(fig, quick=True, out_root=tmp_path / "out", run_folders=[tmp_path / "runs"], **QUIET)
    s = json.loads((out / "summary.json").read_text())
    assert s["faithful"] is False and s["is_result"] is False
    assert s["runs"][0]["unfaithful"] == {"dualpath": ["1 of 9 prefill passes overran (hand-built)"]}


def test_a_plain_dualpath_run_folder_is_accepted(tmp_path):
    """The README's scheduler experiment, run by hand (no plan.json), feeds fig13 directly."""
    balance_run(tmp_path / "r", fig13.scheduler_config(True))
    (tmp_path / "r" / "plan.json").unlink()
    out, _ = reproduce_id("fig13", quick=True, out_root=tmp_path / "out", run_folders=[tmp_path / "r"], seeds=1,
                          **QUIET)
    assert json.loads((out / "summary.json").read_text())["complete"] is True


def test_run_report_says_when_a_balance_rests_on_too_few_steps():
    from testbed.measure.report import _balance_lines

    def summary(steps):
        fwd = {"steps": steps, "median": 1.01, "max": 1.2}
        return {"modes": {"dualpath": {"snic_max_over_avg": 1.1, "forward_attention_max_over_avg": fwd,
                                       "forward_attention_wall_max_over_avg": None, "forward_batches": 9,
                                       "chunked_requests": 0, "paths": {}}}}

    assert "5 steps, fewer than 20: not a result" in _balance_lines(summary(5))[1]
    assert "25 steps)" in _balance_lines(summary(25))[1] and "not a result" not in _balance_lines(summary(25))[1]
