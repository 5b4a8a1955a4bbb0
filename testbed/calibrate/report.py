"""What `dualpath check` and `dualpath bench` print, and the summary a check leaves in results/."""
from __future__ import annotations

import json
from pathlib import Path

from testbed.calibrate.check import CLEAR_LOSS, MODEL_KEEP_OK, RATE_OK, CheckReport


def _mbit(bps: float) -> str:
    return f"{bps / 1e6:7.1f}"


def check_lines(r: CheckReport) -> list[str]:
    lines = [f"link calibration ({r.topology}): wire rate from HTB counters while the flow kept "
             f"the shaper backlogged, vs configured, accepted {RATE_OK[0]}-{RATE_OK[1]}; mean: the "
             f"same span with TCP's stalls",
             f"  {'nic':<10} {'dir':<3} {'class':<6} {'config':>7} {'wire':>7} {'ratio':>6} "
             f"{'mean':>7} {'goodput':>7} {'cpu':>4} {'steal':>5}  Mbit/s"]
    for l in r.links:
        lines.append(f"  {l.nic_kind:<10} {l.direction:<3} {l.traffic_class:<6} {_mbit(l.configured_bps)} "
                     f"{_mbit(l.wire_bps)} {l.ratio:6.3f} {_mbit(l.mean_bps)} {_mbit(l.goodput_bps)} "
                     f"{l.cpu_busy:4.0%} {l.steal:5.0%}  {'ok' if l.ok else 'FAIL'}{': ' + l.note if l.note else ''}")
    m = r.marking
    if m:
        lines.append(f"dscp by port: flow to kv port {m['kv_range_port']['port']} -> "
                     f"{m['kv_range_port']['kv_class_share']:.1%} in the kv class; flow to port "
                     f"{m['other_port']['port']} -> {m['other_port']['model_class_share']:.1%} in the model class")
    for p in r.priority:
        lines.append(f"priority, QoS {'on ' if p.qos else 'off'}: model flow at "
                     f"{p.model_offered_bps / 1e6:.0f} Mbit/s kept {p.kept_ratio:.3f} of its packets "
                     f"({p.model_arrived_pkts} of {p.model_sent_pkts} arrived; iperf3 received "
                     f"{p.iperf_kept_ratio:.3f} of its rate) beside a UDP kv flood sent at "
                     f"{p.kv_sent_bps / 1e6:.0f} Mbit/s that got {p.kv_goodput_bps / 1e6:.0f} Mbit/s; "
                     f"cpu {p.cpu_busy:.0%}")
    if len(r.priority) == 2:
        lines.append(f"  (QoS on must keep >= {MODEL_KEEP_OK} of the model packets; QoS off must keep "
                     f"at least {CLEAR_LOSS} less)")
    if r.cpu_saturated:
        lines.append("FIDELITY: the CPU was saturated during the check; rates may reflect the CPU, "
                     "not the emulated NICs")
    lines.append("RESULT: ok" if r.ok else "RESULT: FAILED: " + "; ".join(r.problems))
    return lines


def write_check(r: CheckReport, run_dir: Path, command: str) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "summary.json").write_text(json.dumps({"command": command, **r.to_dict()}, indent=2) + "\n")
    body = "\n".join(check_lines(r))
    (run_dir / "report.md").write_text(
        f"# dualpath check: {r.topology}\n\nProduced by `{command}`.\n\n```\n{body}\n```\n")


def _rdma_bench_lines(r: dict) -> list[str]:
    def f(x, fmt=".3f"):
        return "-" if x is None else format(x, fmt)

    lines = [f"NIXL over UCX rc_verbs on Soft-RoCE (rxe, RDMA MTU {r['rdma_mtu']}) vs perftest on the same "
             f"link ({r['link']}; rxe {', '.join(r['rxe'].values())}), medians of interleaved rounds"]
    for k, what in (("unshaped", "unshaped"), ("shaped", f"shaped at {r['shaped_rate_bps'] / 1e6:g} Mbit/s")):
        x = r[k]
        lines.append(f"  {what}: READ {f(x['READ_median_GBps'])} GB/s = {f(x['READ_over_perftest_median'], '.2f')} of "
                     f"ib_read_bw ({f(x['perftest_READ_median_GBps'])}), WRITE {f(x['WRITE_median_GBps'])} GB/s = "
                     f"{f(x['WRITE_over_perftest_median'], '.2f')} of ib_write_bw ({f(x['perftest_WRITE_median_GBps'])}); "
                     f"rxe sent_pkts +{x['rxe_sent_pkts']}, proven {x['rdma_proven']}")
        cpu = x.get("machine_cpu_s_per_GB")
        if cpu:
            lines.append(f"    machine CPU per GB moved: user {cpu.get('user')} s, system {cpu.get('system')} s, "
                         f"softirq {cpu.get('softirq')} s (busy {cpu.get('busy_share')})")
    for s in r["unshaped"].get("submission", []):
        lines.append(f"  posting {s['ndesc']} x {s['desc_len'] // 1024} KiB {s['op']}: "
                     f"{s['batch']['post_us_per_desc_median']:.1f} us/descriptor batched (1 request) vs "
                     f"{s['each']['post_us_per_desc_median']:.1f} one by one ({s['post_ratio_each_over_batch']:.1f}x); "
                     f"to completion {s['batch']['total_us_per_desc_median']:.1f} vs {s['each']['total_us_per_desc_median']:.1f}")
    c = r["class_bytes_into_initiator"]
    lines.append(f"  HTB classes into the initiator's CNIC during a READ/WRITE check over rxe: kv {c['kv']} bytes, "
                 f"model {c['model']} bytes")
    lines.append(f"  RDMA {'PROVEN' if r['rdma_proven'] else 'NOT PROVEN'} by the rxe hw_counters "
                 f"(sent_pkts +{r['rxe_sent_pkts']} over the benchmark)" + (f": {r['error']}" if r.get("error") else ""))
    return lines


def bench_lines(what: str, r: dict) -> list[str]:
    if what == "transport" and r.get("transport") == "rdma":
        return _rdma_bench_lines(r)
    if what == "transport":
        lines = [f"NIXL over UCX/TCP vs iperf3 on the same link ({r['link']}), medians of interleaved rounds"]
        for k in ("unshaped", "shaped"):
            x = r[k]
            lines.append(f"  {k:<9} READ {x['READ_median_GBps']:.3f} GB/s ({x['READ_over_iperf3_median']:.2f} of iperf3), "
                         f"WRITE {x['WRITE_median_GBps']:.3f} GB/s ({x['WRITE_over_iperf3_median']:.2f}); "
                         f"iperf3 {x['iperf3']['median_GBps']:.3f} GB/s")
        for s in r["shaped"].get("submission", []):
            lines.append(f"  posting {s['ndesc']} x {s['desc_len'] // 1024} KiB {s['op']}: "
                         f"{s['batch']['post_us_per_desc_median']:.1f} us/descriptor batched (1 request) vs "
                         f"{s['each']['post_us_per_desc_median']:.1f} one by one ({s['post_ratio_each_over_batch']:.1f}x)")
        c = r["class_bytes_into_initiator"]
        lines.append(f"  HTB classes into the initiator's CNIC during a READ/WRITE check: kv {c['kv']} bytes, "
                     f"model {c['model']} bytes (the benchmark's own control socket)")
        return lines
    sh = r["shaped"]
    lines = [f"store reads through the shaped SNIC ({r['snic_rate_bps'] / 1e6:g} Mbit/s) vs iperf3 on it: "
             f"median ratio {sh['ratio_median']:.3f} (runs {', '.join(f'{x:.3f}' for x in sh['ratios'])})"]
    for key in ("unshaped_vs_fio", "unshaped_vs_fio_2_servers"):
        un = r.get(key)
        if un:
            lines.append(f"store reads unshaped ({un['n_servers']} server(s), cold cache, CRC checked) vs fio "
                         f"(O_DIRECT seq read) on the same disk: ratio {un['ratio']:.3f} (store "
                         f"{un['store_cold_gbps']} GB/s, fio {un['fio_direct_gbps']} GB/s; runs {un['ratio_runs']})")
    return lines
