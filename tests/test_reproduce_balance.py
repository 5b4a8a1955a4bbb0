"""fig13 (storage NIC balance from links.jsonl) and fig14 (attention balance from passes.jsonl) on
hand-built time series with known ratios."""
import json

import pytest

from testbed.reproduce import reproduce_id
from testbed.reproduce.fig13 import loaded_window, scheduler_config, snic_series
from testbed.reproduce.fig14 import WINDOW_S, attention_series, attention_windows, balance_config
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


def test_loaded_window_leaves_the_drain_out():
    ser = snic_series(links([1000, 1000, 1000]), dilation=K, window_s=1.0)
    cap = 3 * 1000 * K  # bytes per emulated second at the NICs' rate
    a, b = loaded_window(ser, cap, window_s=1.0)
    assert a == pytest.approx(0.0) and b == pytest.approx(20.0)  # 40 testbed s loaded = 20 emulated s
    assert loaded_window(ser, None, window_s=1.0) == (a, b)  # relative to the busiest window: the same
    assert loaded_window(ser, 10 * cap, window_s=1.0) == (a, b)  # never half that loaded: the busiest window's


def balance_run(path, unfaithful=False):
    cfg = scheduler_config(True)
    f = RunFolder(path, dilation=K, topology="2p1d-io")
    rates = {n: RATE_BPS for n in NICS}
    f.mode("dualpath-rr", snic_rates_bps=rates, links=links([2000, 500, 500]),
           passes=passes([1.0, 1.5, 1.0, 0.5], loaded_steps=6))
    f.mode("dualpath", faithful=not unfaithful, snic_rates_bps=rates, links=links([1000, 1000, 1000]),
           passes=passes([1.0, 1.0, 1.2, 0.8], loaded_steps=6))
    return f.write(plan=plan_json(cfg))


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


def test_fig13_from_a_run(tmp_path):
    balance_run(tmp_path / "runs" / "r")
    out, res = reproduce_id("fig13", quick=True, out_root=tmp_path / "out", run_folders=[tmp_path / "runs"], **QUIET)
    s = json.loads((out / "summary.json").read_text())
    assert s["pngs"] == ["fig13.png"] and is_valid_png(out / "fig13.png") and s["faithful"] is True
    h = {x["name"]: x for x in s["headline"]}
    rr = h["+DualPath (round-robin): storage NIC max/avg, mean over the loaded window"]
    dp = h["DualPath: storage NIC max/avg, mean over the loaded window"]
    assert rr == {"name": rr["name"], "testbed": 2.0, "paper": 1.53, "bound": 1.0}
    assert dp["testbed"] == pytest.approx(1.0) and dp["paper"] == 1.18
    assert s["modes"]["dualpath"]["loaded_window"] == [pytest.approx(0.0), pytest.approx(20.0)]


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


def balance_folder(path, unfaithful=False):
    cfg = balance_config(True)
    f = RunFolder(path, dilation=K, topology="2p1d-io")
    f.mode("dualpath-rr", passes=busy_passes([1.0, 1.5, 1.0, 0.5], loaded_windows=6))
    f.mode("dualpath", faithful=not unfaithful, passes=busy_passes([1.0, 1.0, 1.2, 0.8], loaded_windows=6))
    return f.write(plan=plan_json(cfg))


def test_fig14_from_its_run(tmp_path):
    balance_folder(tmp_path / "runs" / "r")
    out, res = reproduce_id("fig14", quick=True, out_root=tmp_path / "out", run_folders=[tmp_path / "runs"], **QUIET)
    s = json.loads((out / "summary.json").read_text())
    assert s["pngs"] == ["fig14.png"] and is_valid_png(out / "fig14.png") and s["faithful"] is True
    h = {x["name"]: x for x in s["headline"]}
    dp = h["DualPath: attention max/avg across PEs, mean over loaded windows"]
    assert dp["testbed"] == pytest.approx(1.2) and dp["paper"] == 1.06 and dp["bound"] == 1.0
    assert h["+DualPath (round-robin): attention max/avg across PEs, mean over loaded windows"]["testbed"] == \
        pytest.approx(1.5)
    assert h["DualPath: loaded windows (count)"]["testbed"] == 6 / WINDOW_S  # 6 loaded emulated seconds


def test_fig14_has_its_own_compute_loaded_run():
    from testbed.reproduce.fig14 import APPEND_SCALE

    cfg, sched = balance_config(True), scheduler_config(True)
    assert cfg.digest() != sched.digest() and cfg.workload.append_scale == APPEND_SCALE > 1
    assert cfg.topology == sched.topology and cfg.topology_overrides == sched.topology_overrides


@pytest.mark.parametrize("fig", ["fig13", "fig14"])
def test_unfaithful_run_makes_the_figure_unfaithful(tmp_path, fig):
    (balance_run if fig == "fig13" else balance_folder)(tmp_path / "runs" / "r", unfaithful=True)
    out, _ = reproduce_id(fig, quick=True, out_root=tmp_path / "out", run_folders=[tmp_path / "runs"], **QUIET)
    s = json.loads((out / "summary.json").read_text())
    assert s["faithful"] is False and s["runs"][0]["unfaithful"] == {"dualpath": ["1 of 9 prefill passes overran (hand-built)"]}


def test_a_plain_dualpath_run_folder_is_accepted(tmp_path):
    """The README's scheduler experiment, run by hand (no plan.json), feeds fig13 directly."""
    balance_run(tmp_path / "r")
    (tmp_path / "r" / "plan.json").unlink()
    out, _ = reproduce_id("fig13", quick=True, out_root=tmp_path / "out", run_folders=[tmp_path / "r"], **QUIET)
    assert json.loads((out / "summary.json").read_text())["complete"] is True
