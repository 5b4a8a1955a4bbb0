"""Isolation: the model's collectives beside saturating KV traffic, QoS on against QoS off.

The paper argues that virtual lanes keep KV transfers from delaying the model's collectives but
never shows it. One run (testbed/experiments/isolation.py) on 1p1d-isolation (DS 660B's per-layer AllToAll
over the CNICs, model class) runs one workload in three conditions: idle (no KV traffic), under a
saturating kv-class load into every CNIC with QoS on, and the same load with `qos: off`. From it:
collective latency p50/p99, forward-pass time (prefill passes and decode steps), TTFT and TPOT per
condition; the kv load's throughput with QoS on over off; and the bytes of each class from the
kernel's counters (nftables by DSCP, HTB per class).

Acceptance (issue 12), judged here and never loosened: QoS on, collective p99 under load <= 1.1x
idle's; QoS off, >= 2x; kv throughput with QoS on >= 0.9 of QoS off's; TTFT and TPOT the same
pattern (on <= 1.1x idle, off >= 2x idle, at p99 and p50); every condition FAITHFUL.

The headline compares every collective of each condition, pooled: that is what a user of the
cluster sees. A prefill pass's AllToAll carries its batch's tokens and batching shifts with small
timing differences, so the pools hold different sizes; the same comparison over the collectives
whose (role, tokens) occurs in all three conditions (each size as often as the condition that ran
it least, earliest first) is the second row (`collective_matched`).

Under QoS off the collectives queue behind the kv load in one FIFO per shaped link (a bfifo of
emulators/nic.py QUEUE_BYTES), so their latency grows while that queue fills: the report gives
the queue's depth in time at the CNIC's rate and each condition's latency over its run: its
median by third, the level it settled at and from when, and whether that was early enough to call
the run steady (`trend`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np

from emulators.nic import QUEUE_BYTES
from testbed.measure import plots
from testbed.measure.collectives import collective_rows
from testbed.measure.metrics import percentiles
from testbed.reproduce.common import Headline, Result, UsedRun, ratio
from testbed.reproduce.plan import Plan, RunConfig, WorkloadSpec
from testbed.reproduce.spread import Draws, map_draws, sample_draws, sample_ratio_draws

ID = "isolation"
TITLE = "Collectives beside saturating KV traffic: QoS on vs QoS off"
TOPOLOGY = "1p1d-isolation"
CONDITIONS = ("idle", "qos_on", "qos_off")  # = testbed.experiments.isolation.CONDITIONS (not imported: it needs the testbed)
LABELS = {"idle": "idle (no KV traffic)", "qos_on": "KV load, QoS on", "qos_off": "KV load, QoS off"}
COLORS = {"idle": "#55a868", "qos_on": "#4c72b0", "qos_off": "#c44e52"}
ON_MAX = 1.1  # QoS on: at most this times idle
OFF_MIN = 2.0  # QoS off: at least this times idle
KV_MIN = 0.9  # kv throughput with QoS on over off
FLAT_MAX = 1.25  # flat: the last third's median at most this times the middle third's
PLATEAU_BAND = 0.1  # a latency has settled once its running median stays within 10 % of its final level


def config(quick: bool) -> RunConfig:
    agents = 16 if quick else 24
    turns_scale = 2.0 if quick else 1.0
    return RunConfig(f"isolation/{TOPOLOGY}/{agents}", TOPOLOGY, CONDITIONS,
                     WorkloadSpec(agents=agents, turns_scale=turns_scale), params={"agents": agents})


def plan(quick: bool = False) -> Plan:
    cfg = config(quick)
    topo = cfg.topology_obj()
    return Plan(ID, quick, [cfg], scale_down=(
        f"1P1D with two engines per node ({TOPOLOGY}: links x{topo.spec.scale:g}, CNIC {topo.cnic_bps / 1e9:g} Gbit/s); "
        "target DS 660B on H800, "
        "whose EP-16 AllToAll (1.26 MB per token over a GPU's CNIC) is scaled like KV; the demo workload with "
        f"{cfg.workload.agents} agents{' and half the turns' if quick else ''}, every request in oracle mode (no KV of "
        "its own); the KV load is one loss-based TCP flow per engine from its node's host port, in the kv class"),
        notes=["one run, three conditions on one cluster: idle, kv load with QoS on, the same load with QoS off"])


def run_config(cfg: RunConfig, run_dir: Path, command: str, progress: Callable[[str], None] = print,
               checkpoint: Path | None = None):
    """The isolation run of `cfg` into run_dir (root, the testbed): the executor's runner for this id."""
    from dualpath.model.registry import prepare_tiny as demo_checkpoint
    from testbed.experiments.isolation import run_isolation
    from testbed.reproduce.execute import build_workload
    from testbed.measure.runs import load_run, write_plan

    topo = cfg.topology_obj()
    ckpt = checkpoint or demo_checkpoint()
    progress(f"  run {cfg.describe()}")
    run_isolation(topo, build_workload(cfg, 1.0), ckpt, run_dir, command, progress, quota_s=cfg.quota_ms / 1000,
                  conditions=cfg.modes, extra={"workload_spec": cfg.to_dict()["workload"]})
    write_plan(run_dir, {"key": cfg.key, "digest": cfg.digest(), "config": cfg.to_dict()})
    return load_run(run_dir)


# --------------------------------------------------------------------------- analysis (pure)


def _pcts(values: list[float], k: float) -> dict[str, Any]:
    tb = percentiles(values, (50, 90, 99))
    return {**{p: (v / k if v is not None else None) for p, v in tb.items()}, "testbed_s": tb, "n": len(values)}


def matched_collectives(rows: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """Each condition's collectives cut to the same multiset of sizes: for every (role, tokens)
    that all conditions ran, the earliest n of each, n the fewest any condition ran."""
    def by_size(rs: list[dict]) -> dict[tuple, list[dict]]:
        out: dict[tuple, list[dict]] = {}
        for r in sorted(rs, key=lambda r: r["t"]):
            out.setdefault((r["role"], r["tokens"]), []).append(r)
        return out

    grouped = {c: by_size(rs) for c, rs in rows.items()}
    common = set.intersection(*(set(g) for g in grouped.values())) if grouped else set()
    n = {key: min(len(g[key]) for g in grouped.values()) for key in common}
    return {c: [r for key in sorted(common) for r in g[key][:n[key]]] for c, g in grouped.items()}


def trend(rows: list[dict], k: float) -> dict[str, Any]:
    """A condition's collective latency over its run (emulated s): the medians of its thirds, its
    final level (the median of its last tenth), and from when it stayed within PLATEAU_BAND of
    that level (`settled_at_s`, since the first collective; every later window of
    consecutive collectives' median in the band). `steady`: it was flat (its last third's median at
    most FLAT_MAX times its middle third's) or settled before the run's last third began, so a
    longer run would add more of the same; None with too few collectives."""
    rs = sorted(rows, key=lambda r: r["t"])
    if len(rs) < 30:
        return {"p50_by_third": None, "final_s": None, "settled_at_s": None, "span_s": None, "steady": None,
                "n": len(rs)}
    xs, ts = [r["s"] / k for r in rs], [(r["t"] - rs[0]["t"]) / k for r in rs]
    n = len(xs) // 3
    thirds = [percentiles(xs[i * n:(i + 1) * n if i < 2 else len(xs)], (50,))["p50"] for i in range(3)]
    final = percentiles(xs[-max(3, len(xs) // 10):], (50,))["p50"]
    w = max(5, len(xs) // 20)
    settled = 0
    for i in range(0, len(xs) - w + 1, w):
        if abs(percentiles(xs[i:i + w], (50,))["p50"] - final) > PLATEAU_BAND * final:
            settled = min(i + w, len(xs) - 1)
    at = ts[settled]
    flat = thirds[2] <= FLAT_MAX * thirds[1]
    return {"p50_by_third": thirds, "final_s": final, "settled_at_s": round(at, 4), "span_s": round(ts[-1], 4),
            "flat": flat, "steady": flat or at <= ts[-1] * 2 / 3, "n": len(xs)}


def queue_depth(topo) -> dict[str, Any]:
    """How long one shaped CNIC's class queue takes to drain at the CNIC's rate: the most a FIFO
    behind a saturating load can add to a collective (testbed and emulated s)."""
    testbed_s = QUEUE_BYTES * 8 / topo.cnic_bps
    return {"queue_bytes": QUEUE_BYTES, "cnic_bps": topo.cnic_bps, "drain_testbed_s": round(testbed_s, 4)}


def condition_numbers(run, cond: str, matched: list[dict] | None = None) -> dict[str, Any]:
    """Everything the figure reads of one condition, in emulated seconds (testbed beside);
    `collective` is over every collective, `collective_matched` over `matched` (matched_collectives)."""
    k = run.dilation
    m = run.mode(cond)
    everything = collective_rows(run.passes(cond), run.steps(cond))
    rows = everything if matched is None else matched
    passes = [p["t_end"] - p["t_start"] for p in run.passes(cond)]
    steps = [s["t_end"] - s["t_start"] for s in run.steps(cond)]
    iso = m.get("isolation") or {}
    coll = m.get("collectives") or {}
    return {
        "faithful": bool(m.get("faithful")), "unfaithful_reasons": m.get("unfaithful_reasons") or [],
        "collective": _pcts([r["s"] for r in everything], k),
        "collective_matched": _pcts([r["s"] for r in rows], k),
        "collective_trend": trend(everything, k),
        "collective_prefill": _pcts([r["s"] for r in everything if r["role"] == "prefill"], k),
        "collective_decode": _pcts([r["s"] for r in everything if r["role"] == "decode"], k),
        "prefill_pass": _pcts(passes, k), "decode_step": _pcts(steps, k),
        "ttft_s": m.get("ttft_s"), "tpot_s": m.get("tpot_s"),
        "kv_bytes_per_s": iso.get("kv_bytes_per_s"),
        "class_bytes": iso.get("class_bytes") or {},
        "htb_model_class_bytes_on_nics": (m.get("control_bytes") or {}).get("model_class_on_nics"),
        "collective_bytes": (coll.get("sent_bytes", 0) + coll.get("received_bytes", 0)) or None,
        "cnic_rx_share_of_rate": iso.get("cnic_rx_share_of_rate") or {},
        "qos": iso.get("qos"), "cpu_busy": m.get("cpu_busy"),
    }


def checks(nums: dict[str, dict]) -> dict[str, Any]:
    """The issue's acceptance comparisons, each with the two numbers it compares."""
    def rel(metric: str, p: str, cond: str) -> float | None:
        return ratio(_get(nums, cond, metric, p), _get(nums, "idle", metric, p))

    out: dict[str, Any] = {}
    for metric, p in (("collective", "p99"), ("ttft_s", "p99"), ("ttft_s", "p50"), ("tpot_s", "p99"), ("tpot_s", "p50")):
        on, off = rel(metric, p, "qos_on"), rel(metric, p, "qos_off")
        out[f"{metric}_{p}"] = {"qos_on_over_idle": on, "qos_off_over_idle": off,
                                "qos_on_ok": on is not None and on <= ON_MAX,
                                "qos_off_ok": off is not None and off >= OFF_MIN}
    kv = ratio(nums.get("qos_on", {}).get("kv_bytes_per_s"), nums.get("qos_off", {}).get("kv_bytes_per_s"))
    out["kv_throughput"] = {"on_over_off": kv, "ok": kv is not None and kv >= KV_MIN}
    out["all_faithful"] = all(nums.get(c, {}).get("faithful") for c in CONDITIONS)
    return out


def _get(nums: dict, cond: str, metric: str, p: str) -> float | None:
    v = (nums.get(cond) or {}).get(metric) or {}
    return v.get(p) if isinstance(v, dict) else None


# --------------------------------------------------------------------------- plots


def _cdf(ax, values: list[float], cond: str, scale: float) -> None:
    if not values:
        return
    xs = np.sort(np.asarray(values) * scale)
    ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), color=COLORS[cond], label=f"{LABELS[cond]} (n={len(xs)})", lw=1.4)


def render(run, nums: dict[str, dict], out: Path) -> list[str]:
    k = run.dilation
    conds = [c for c in CONDITIONS if run.has(c)]
    pngs = []
    for role, title in (("prefill", "prefill passes"), ("decode", "decode steps")):
        fig, ax = plots.new_figure(f"Isolation: collective latency CDF, {title} (AllToAll per layer)",
                                   "collective latency (emulated ms)", "share of collectives")
        for c in conds:
            _cdf(ax, [r["s"] for r in collective_rows(run.passes(c), run.steps(c)) if r["role"] == role], c, 1e3 / k)
        ax.set_xscale("log")
        pngs.append(plots.finish(fig, ax, out / f"isolation_collective_cdf_{role}.png",
                                 "Each condition's per-layer collectives of every engine; QoS on should sit on idle, "
                                 "QoS off to the right. Emulated ms = testbed ms / dilation.", ncol=1))
    for metric, key, unit in (("TTFT", "ttft", "s"), ("TPOT", "tpot", "s")):
        fig, ax = plots.new_figure(f"Isolation: {metric} CDF", f"{metric} (emulated {unit})", "share of requests")
        for c in conds:
            _cdf(ax, [r[f"{key}_s"] for r in run.records(c) if r.get(f"{key}_s") is not None], c, 1.0)
        pngs.append(plots.finish(fig, ax, out / f"isolation_{key}_cdf.png",
                                 "Every request of the workload in each condition (oracle requests: no KV of their own).",
                                 ncol=1))
    fig, ax = plots.new_figure("Isolation: forward-pass time CDF (prefill passes)", "pass time (emulated s)",
                               "share of passes")
    for c in conds:
        _cdf(ax, [p["t_end"] - p["t_start"] for p in run.passes(c)], c, 1 / k)
    pngs.append(plots.finish(fig, ax, out / "isolation_pass_cdf.png",
                             "A pass is its layers' compute windows plus the collective each layer waits for.", ncol=1))
    # time series: every collective's latency over the condition's time, and the kv load's rate
    fig, ax = plots.new_figure("Isolation: collective latency over time", "time since the condition's start (emulated s)",
                               "collective latency (emulated ms)")
    for c in conds:
        rows = collective_rows(run.passes(c), run.steps(c))
        if rows:
            t0 = min(r["t"] for r in rows)
            ax.scatter([(r["t"] - t0) / k for r in rows], [r["s"] * 1e3 / k for r in rows], s=3, alpha=0.5,
                       color=COLORS[c], label=LABELS[c])
    ax.set_yscale("log")
    pngs.append(plots.finish(fig, ax, out / "isolation_collective_series.png",
                             "Each dot is one layer's AllToAll (prefill and decode). Time axes start at each condition's "
                             "first collective.", ncol=1))
    fig, ax = plots.new_figure("Isolation: what the CNICs received over time", "time since the condition's start (emulated s)",
                               "CNIC receive rate, all engines (Mbit/s, testbed)")
    for c in conds:
        xs, ys = _rx_rate(run.links(c), k)
        if xs:
            ax.plot(xs, ys, color=COLORS[c], label=LABELS[c], lw=1)
    pngs.append(plots.finish(fig, ax, out / "isolation_cnic_series.png",
                             "Sum over every engine's CNIC of the bytes it received per 0.25 s sample (interface counters): "
                             "the kv load plus the collectives.", ncol=1))
    return pngs


def _rx_rate(samples: list[dict], k: float) -> tuple[list[float], list[float]]:
    if len(samples) < 2:
        return [], []
    tot = [sum(v[0] for n, v in s["nics"].items() if n.endswith("/cnic")) for s in samples]
    ts = [s["t"] for s in samples]
    xs, ys = [], []
    for i in range(1, len(samples)):
        dt = ts[i] - ts[i - 1]
        if dt > 0:
            xs.append((ts[i] - ts[0]) / k)
            ys.append((tot[i] - tot[i - 1]) * 8 / dt / 1e6)
    return xs, ys


# --------------------------------------------------------------------------- reproduce


def reproduce(runs: dict, out: Path, quick: bool = False) -> Result:
    cfg = config(quick)
    run = runs.get(cfg.key)
    if run is None and len(runs) == 1:
        run = next(iter(runs.values()))
    conds = [c for c in CONDITIONS if run is not None and run.has(c)]
    colls = {c: collective_rows(run.passes(c), run.steps(c)) for c in conds}
    matched = matched_collectives(colls)
    nums = {c: condition_numbers(run, c, matched[c]) for c in conds}
    chk = checks(nums)
    p99 = {c: _get(nums, c, "collective", "p99") for c in CONDITIONS}
    p99_tb = {c: ((nums.get(c) or {}).get("collective") or {}).get("testbed_s", {}).get("p99") for c in CONDITIONS}
    over = {c: ratio(p99[c], p99["idle"]) for c in ("qos_on", "qos_off")}
    p99_matched = {c: _get(nums, c, "collective_matched", "p99") for c in CONDITIONS}
    over_matched = {c: ratio(p99_matched[c], p99_matched["idle"]) for c in ("qos_on", "qos_off")}
    kv = chk["kv_throughput"]["on_over_off"]
    queue = queue_depth(cfg.topology_obj())
    if run is not None:
        queue["drain_emulated_s"] = round(queue["drain_testbed_s"] / run.dilation, 4)
    data = {
        "collective_p99_s": p99, "collective_p99_testbed_s": p99_tb,
        "collective_p50_s": {c: _get(nums, c, "collective", "p50") for c in CONDITIONS},
        "p99_over_idle": over, "kv_throughput_on_over_off": kv,
        "collective_p99_matched_s": p99_matched, "p99_over_idle_matched": over_matched,
        "collective_trend": {c: (nums.get(c) or {}).get("collective_trend") for c in CONDITIONS},
        "queue": queue,
        "model_class_bytes": {c: (nums.get(c) or {}).get("class_bytes", {}).get("model") for c in CONDITIONS},
        "kv_class_bytes": {c: (nums.get(c) or {}).get("class_bytes", {}).get("kv") for c in CONDITIONS},
        "checks": chk, "conditions": nums, "dilation": run.dilation if run else None,
        "thresholds": {"qos_on_max_over_idle": ON_MAX, "qos_off_min_over_idle": OFF_MIN, "kv_on_over_off_min": KV_MIN,
                       "flat_last_over_middle_third_max": FLAT_MAX, "plateau_band": PLATEAU_BAND},
    }
    heads = [Headline.of(f"collective p99, {LABELS[c]} (emulated ms, all collectives)",
                         p99_draws(colls, c, run.dilation if run else 1.0).estimate()) for c in CONDITIONS]
    heads += [Headline.of("collective p99 with QoS on / idle (x, all collectives; issue: <= 1.1)",
                          p99_ratio_draws(colls, "qos_on").estimate(), None, 1.0),
              Headline.of("collective p99 with QoS off / idle (x, all collectives; issue: >= 2)",
                          p99_ratio_draws(colls, "qos_off").estimate()),
              Headline.of("collective p99 with QoS on / idle (x, the sizes all conditions ran)",
                          p99_ratio_draws(matched, "qos_on").estimate(), None, 1.0),
              Headline.of("collective p99 with QoS off / idle (x, the sizes all conditions ran)",
                          p99_ratio_draws(matched, "qos_off").estimate()),
              Headline.of("kv load throughput, QoS on / off (x; issue: >= 0.9)",
                          kv_ratio_draws(run, kv).estimate() if run is not None else None, None, 1.0)]
    for metric in ("ttft_s", "tpot_s"):
        heads += [Headline.of(f"{metric[:4].upper()} p99 with QoS on / idle (x)",
                              request_p99_ratio_draws(run, metric, "qos_on").estimate(), None, 1.0),
                  Headline.of(f"{metric[:4].upper()} p99 with QoS off / idle (x)",
                              request_p99_ratio_draws(run, metric, "qos_off").estimate())]
    notes = _notes(nums, chk, queue)
    used = [UsedRun(cfg.key, run, tuple(nums))] if run is not None else []
    pngs = render(run, nums, out) if run is not None else []
    return Result(ID, TITLE, heads, pngs, used, data=data, notes=notes, scale_down=plan(quick).scale_down,
                  sections=_table(nums))


def p99_draws(colls: dict[str, list[dict]], cond: str, k: float) -> Draws:
    """A condition's collective p99 in emulated ms, with a bootstrap over its collectives."""
    return map_draws(sample_draws([r["s"] for r in colls.get(cond, [])], "collectives", q=99),
                     lambda x: x / k * 1e3)


def p99_ratio_draws(colls: dict[str, list[dict]], cond: str) -> Draws:
    """A condition's collective p99 over idle's, with a bootstrap over each one's collectives."""
    return sample_ratio_draws([r["s"] for r in colls.get(cond, [])], [r["s"] for r in colls.get("idle", [])],
                              "collectives", q=99)


def request_p99_ratio_draws(run, metric: str, cond: str) -> Draws:
    """A condition's request p99 (ttft_s or tpot_s) over idle's, with a bootstrap over each one's
    requests (the warm-up request left out, as in the summary's percentiles)."""
    def values(c: str) -> list[float]:
        if run is None or not run.has(c):
            return []
        return [r[metric] for r in run.records(c) if r.get("trajectory", 0) >= 0 and r.get(metric) is not None]

    return sample_ratio_draws(values(cond), values("idle"), "requests", q=99)


def cnic_rx_rates(run, cond: str) -> list[float]:
    """The engines' CNIC rx rate (bytes per testbed s, summed over engines) in each sample window
    inside the condition's request window: under the kv load that is the load (oracle requests
    move no KV; the collectives are a few kB per pass)."""
    lo, hi = ((run.mode(cond).get("isolation") or {}).get("request_window_testbed_s") or [None, None])
    samples = [s for s in run.links(cond) if lo is None or lo <= s["t"] <= hi]
    rx = [sum(v[0] for n, v in s["nics"].items() if n.endswith("/cnic")) for s in samples]
    return [(rx[i] - rx[i - 1]) / dt for i in range(1, len(samples))
            if (dt := samples[i]["t"] - samples[i - 1]["t"]) > 0]


def kv_ratio_draws(run, kv: float | None) -> Draws:
    """The kv load's throughput with QoS on over off (`kv`, from the DSCP class's byte counters),
    with an interval from a bootstrap over the sample windows of the engines' CNIC rx rate, each
    replicate scaled so that all windows give `kv` (the class counters have no windows)."""
    if kv is None or not run.has("qos_on") or not run.has("qos_off"):
        return Draws(kv, None, 0, "")
    d = sample_ratio_draws(cnic_rx_rates(run, "qos_on"), cnic_rx_rates(run, "qos_off"), "sample windows")
    if d.value is None:
        return Draws(kv, None, 0, d.method)
    method = d.method + " of the engines' CNIC rx rate, scaled to the kv class's byte ratio"
    return Draws(kv, None if d.draws is None else d.draws * (kv / d.value), d.n, method)


def _notes(nums: dict, chk: dict, queue: dict) -> list[str]:
    out = ["The paper gives no number for this experiment (it argues for virtual lanes without measuring QoS off); "
           "the columns 'paper' are empty and the thresholds are the issue's."]
    c = chk["collective_p99"]
    verdicts = [("QoS on keeps collective p99 within 1.1x idle", c["qos_on_ok"]),
                ("QoS off makes collective p99 at least 2x idle", c["qos_off_ok"]),
                ("kv throughput with QoS on is at least 0.9 of QoS off", chk["kv_throughput"]["ok"])]
    for m in ("ttft_s_p99", "tpot_s_p99"):
        verdicts.append((f"{m[:4].upper()} p99: QoS on within 1.1x idle", chk[m]["qos_on_ok"]))
        verdicts.append((f"{m[:4].upper()} p99: QoS off at least 2x idle", chk[m]["qos_off_ok"]))
    out += [f"{'MET' if ok else 'NOT MET'}: {what}" for what, ok in verdicts]
    if nums:
        same = ", ".join(f"{c} {n['collective_matched']['n']} of {n['collective']['n']}" for c, n in nums.items())
        out.append(f"The verdicts are over every collective of each condition (pooled); over the sizes all three ran "
                   f"(matched_collectives: {same} collectives) they are the second rows.")
    if "drain_emulated_s" in queue:
        out.append(f"Each shaped link's class queue is a bfifo of {queue['queue_bytes'] / 2 ** 20:g} MiB "
                   f"(emulators/nic.py QUEUE_BYTES, deep so the lossless fabric drops nothing): at the CNIC's "
                   f"{queue['cnic_bps'] / 1e6:g} Mbit/s it drains in {queue['drain_testbed_s'] * 1e3:.0f} ms here, "
                   f"{queue['drain_emulated_s'] * 1e3:.1f} emulated ms: the most a FIFO behind the kv load can add to "
                   f"a collective at each shaped queue it passes (its sender's CNIC and its receiver's), so QoS off's "
                   f"latencies depend on how full the load keeps them.")
    for cond, n in nums.items():
        t = n.get("collective_trend") or {}
        if t.get("p50_by_third"):
            a, b, c = (x * 1e3 for x in t["p50_by_third"])
            level = ("flat: steady" if t["flat"] else
                     f"it climbed and settled at {t['final_s'] * 1e3:.3g} ms from {t['settled_at_s']:.2f} s of its "
                     f"{t['span_s']:.2f} s" + (": steady from then on" if t["steady"] else
                                              ", in the run's last third: not a steady state over the run, so its "
                                              "p99 depends on the run's length"))
            out.append(f"{cond}: collective median by third of the run {a:.3g}, {b:.3g}, {c:.3g} emulated ms; {level}.")
    for cond, n in nums.items():
        cb, coll = n["class_bytes"], n["collective_bytes"]
        if cb.get("model") and coll:
            out.append(f"{cond}: nftables counted {cb['model']:,} bytes sent with DSCP 46 (EF) for the collectives' "
                       f"{coll:,} payload bytes (x{cb['model'] / coll:.3f}: IP and TCP headers, ACKs), "
                       f"{cb.get('kv', 0):,} with DSCP 10 (AF11)")
    return out


def _table(nums: dict) -> list[str]:
    def ms(d: dict | None, p: str) -> str:
        v = (d or {}).get(p)
        return "—" if v is None else f"{v * 1e3:.2f}"

    rows = ["## Per condition (emulated; collective and pass times in ms, TTFT/TPOT in ms)", "",
            "| condition | verdict | collective p50 | p99 | same sizes, p99 | prefill coll. p99 | decode coll. p99 | prefill pass p50 | p99 "
            "| decode step p50 | TTFT p50 | p99 | TPOT p50 | p99 | kv load (Mbit/s here) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c, n in nums.items():
        kv = n.get("kv_bytes_per_s")
        rows.append(f"| {LABELS[c]} | {'FAITHFUL' if n['faithful'] else 'UNFAITHFUL'} | {ms(n['collective'], 'p50')} | "
                    f"{ms(n['collective'], 'p99')} | {ms(n['collective_matched'], 'p99')} | {ms(n['collective_prefill'], 'p99')} | "
                    f"{ms(n['collective_decode'], 'p99')} | {ms(n['prefill_pass'], 'p50')} | {ms(n['prefill_pass'], 'p99')} | "
                    f"{ms(n['decode_step'], 'p50')} | {ms(n['ttft_s'], 'p50')} | {ms(n['ttft_s'], 'p99')} | "
                    f"{ms(n['tpot_s'], 'p50')} | {ms(n['tpot_s'], 'p99')} | "
                    f"{'—' if kv is None else f'{kv * 8 / 1e6:.0f}'} |")
    bad = [(c, n["unfaithful_reasons"]) for c, n in nums.items() if not n["faithful"]]
    if bad:
        rows += ["", "Unfaithful conditions:"] + [f"- {c}: " + "; ".join(r) for c, r in bad]
    return rows
