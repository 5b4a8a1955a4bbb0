"""What a run's report says: its verdict, its failed checks, and the lines `dualpath run` prints."""
from __future__ import annotations

from testbed.measure.fidelity import CPU_BUSY_MAX, OVERRUN_SHARE, SATURATION_MIN
from testbed.measure.metrics import MIN_LOADED


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}"


def run_verdict(summary: dict) -> str:
    """The run's verdict in one line: a result only when every mode is FAITHFUL (testbed/measure/fidelity.py)."""
    bad = [m for m, v in summary["modes"].items() if not v["faithful"]]
    rules = (f"passes and steps kept their emulated windows (at most {OVERRUN_SHARE:.0%} overran), mean CPU busy "
             f"<= {CPU_BUSY_MAX:.0%}, every bottleneck storage NIC carried >= {SATURATION_MIN:.0%} of its rate")
    if not bad:
        return f"verdict: FAITHFUL in every mode ({rules})"
    return f"verdict: UNFAITHFUL in {', '.join(bad)}: not a result (reasons under each mode)"


def verdict_lines(summary: dict) -> list[str]:
    """One line per mode that starts with its fidelity verdict, then times in emulated seconds."""
    t = summary.get("time", {})
    if t.get("compute") == "cpu":
        head = f"time: the host CPU's own (compute: cpu; target {summary.get('target')} not emulated)"
    else:
        head = (f"time: emulated {summary.get('target')}; dilation k = {summary.get('dilation', 1):.4g} "
                f"(one emulated second lasts {summary.get('dilation', 1):.3g} s here); times below are emulated, "
                f"testbed seconds in brackets")
    lines = [run_verdict(summary), head]
    for mode, m in summary["modes"].items():
        sp = m.get("speedup_over_basic")
        speed = f"  {sp:.2f}x basic (bound {m['speedup_bound']:.2f}x)" if sp is not None and "speedup_bound" in m else ""
        lines.append(f"{mode:<14} {'FAITHFUL' if m['faithful'] else 'UNFAITHFUL':<10} JCT {m['jct_s']:8.3f} s "
                     f"[{m['jct_testbed_s']:.1f}]{speed}  TTFT p50/p99 {_ms(m['ttft_s']['p50'])}/{_ms(m['ttft_s']['p99'])} ms"
                     f"  TPOT p50 {_ms(m['tpot_s']['p50'])} ms  CPU {m['cpu_busy']:.0%} (own {m.get('cpu_testbed_processes', 0):.0%}"
                     + (f", steal {m['cpu_steal']:.0%}" if m.get("cpu_steal") else "") + ")")
        for why in m.get("unfaithful_reasons", []):
            lines.append(f"{'':<14} - {why}")
        for note in m.get("fidelity_notes", []):
            lines.append(f"{'':<14} note: {note}")
    return lines


def failed_checks(summary: dict) -> list[str]:
    """One line per check a mode failed, naming the request, the layer or the NIC: what makes
    `dualpath run` exit non-zero. With faults, a request may fail alone and the bytes of retried
    attempts are not in the expected counts; nothing may be wrong or lost."""
    faults = "fault_injection" in summary
    out = []
    for mode, m in summary["modes"].items():
        v = m["verification"]
        first = v.get("first_failed_check")
        if v.get("all_match") is False:
            where = (f"request {first['request']}" + (f", layer {first['layer']}" if first.get("layer") is not None
                                                        else "")) if first else f"request {v.get('first_mismatch')}"
            what = {"pe_kv_bit_exact": "the past KV the PE loaded differs from the recomputation's",
                    "de_kv_bit_exact": "the prompt KV the DE loaded differs from the recomputation's",
                    "tokens_match": "its tokens differ from the recomputation's"}.get(first["check"] if first else "", "")
            out.append(f"{mode}: check {first['check'] if first else 'verification'} failed at {where}: {what}")
        for f in m.get("faults", []):
            if f.get("wrong_tokens") or f.get("lost_blocks"):
                out.append(f"{mode}: fault {f['kind']}:{f.get('target') or ''}: {f.get('wrong_tokens', 0)} wrong "
                           f"token(s), {f.get('lost_blocks', 0)} lost block(s)")
        if faults:
            continue
        if m["errors"]:
            e = m.get("first_error") or {}
            out.append(f"{mode}: check errors failed: {m['errors']} request(s) failed; the first, "
                       f"{e.get('request', '?')}: {e.get('error', '?')}")
        acc = m["kv_bytes_vs_expected"]
        bad = [r for r in acc["per_nic"] if not r["ok"]]
        if bad:  # the NIC furthest off names the problem; the table above has every one
            r = max(bad, key=lambda x: abs(x["measured"] - x["expected"]))
            out.append(f"{mode}: check kv_bytes_vs_expected failed on {len(bad)} of {acc['nics']} NICs; furthest off "
                       f"{r['nic']}: expected {r['expected'] / 1e6:.2f} MB by the path definitions, measured "
                       f"{r['measured'] / 1e6:.2f} MB in the kv class (KV sent in another class, re-sent, or bytes "
                       f"no path defines)")
    return out


def e2e_lines(summary: dict) -> list[str]:
    """The main job's summary: the verdict and times per mode, correctness, KV bytes per NIC."""
    lines = verdict_lines(summary)
    if summary.get("device", "cpu") != "cpu":
        lines.append(f"engines computed on {summary['device']}: weights and KV in GPU memory, staged through "
                     f"page-locked host memory; checked against a recomputation on {summary['device']}")
    lines.extend(cluster_lines(summary))
    sampled = next((m["verification"]["sample"] for m in summary["modes"].values()
                    if "sample" in m["verification"]), None)
    if sampled:
        lines.append(f"verified a sample: every request of {sampled['trajectories']} of the {sampled['of']} "
                     f"trajectories, drawn with seed {sampled['seed']} (--verify sample:N)")
    lines.append(f"{'mode':<14} {'reqs':>4} {'err':>3} {'tokens=recompute':>16} {'KV bit-exact (PE/DE)':>21} "
                 f"{'hit':>5} {'hit KV in HBM':>13} {'NIC bytes ok':>12}")
    for mode, m in summary["modes"].items():
        v = m["verification"]
        tok = (f"{v['tokens_match']}/{v['requests']}" if "tokens_match" in v else "n/a (oracle)")
        kv = f"{v['pe_kv_bit_exact']} {v['de_kv_bit_exact']}" if "pe_kv_bit_exact" in v else "n/a"
        acc = m["kv_bytes_vs_expected"]
        hbm = m["peak_hit_kv_layers_in_hbm"]["max"]
        lines.append(f"{mode:<14} {m['requests']:>4} {m['errors']:>3} {tok:>16} {kv:>21} "
                     f"{m['hit_rate']:>5.3f} {hbm:>7.1f} layers {acc['within']:>4}/{acc['nics']:<3}")
    lines.append("KV bytes per NIC (tx+rx, MB): expected by the path definitions / measured from HTB kv-class "
                 f"counters, payload only (tolerance {next(iter(summary['modes'].values()))['kv_bytes_vs_expected']['tolerance']:.0%})")
    nics = [r["nic"] for r in next(iter(summary["modes"].values()))["kv_bytes_vs_expected"]["per_nic"]]
    lines.append(f"  {'nic':<22}" + "".join(f"{mode:>20}" for mode in summary["modes"]))
    for nic in nics:
        cells = []
        for m in summary["modes"].values():
            r = next((x for x in m["kv_bytes_vs_expected"]["per_nic"] if x["nic"] == nic), None)
            cells.append("-" if r is None else
                         f"{r['expected'] / 1e6:.1f}/{r['measured'] / 1e6:.1f}{'' if r['ok'] else '!'}")
        lines.append(f"  {nic:<22}" + "".join(f"{c:>20}" for c in cells))
    retries = {mode: m["rdma"]["retries"] for mode, m in summary["modes"].items() if (m.get("rdma") or {}).get("retries")}
    if retries:
        lines.append("RoCE re-sends (rxe hw_counters, all devices; rxe counts events, not bytes, so the bytes "
                     "they re-sent stay in the measured counts above): " + "; ".join(
                         f"{mode} retries {r['completer_retry_err']} (NAKs {r['rcvd_seq_err']}), duplicates "
                         f"{r['duplicate_request']}, out of order {r['out_of_seq_request']}" for mode, r in retries.items()))
    ctrl = {mode: m["control_bytes"]["model_class_on_nics"] for mode, m in summary["modes"].items()}
    lines.append("control (model class, all NICs, MB): " + ", ".join(f"{k} {v / 1e6:.2f}" for k, v in ctrl.items()))
    lines.extend(_balance_lines(summary))
    lines.extend(batch_lines(summary))
    lines.extend(conversation_lines(summary))
    lines.extend(fault_lines(summary))
    if summary.get("connector"):
        c = summary["connector"]
        lines.append(f"connector: {c['spec']} ({c['name']}, contract v{c['contract_version']}) in modes "
                     f"{','.join(c.get('modes', []))}: every check above applies to it")
    bad = failed_checks(summary)
    lines.extend(["FAILED checks:", *(f"  {x}" for x in bad)] if bad else ["every check passed"])
    return lines


def cluster_lines(summary: dict) -> list[str]:
    """A run over several servers: which server ran which node, each other server's CPU per mode,
    and the kernels every process computed with (dualpath/model/numerics.py)."""
    if "cluster" not in summary:
        return []
    c = summary["cluster"]
    held = {srv: [u for u, s in c["placement"].items() if s == srv] for srv in c["servers"]}
    kernels = ("every process computed with the portable kernels ("
               + ", ".join(f"{k}={v}" for k, v in c["kernels"]["env"].items()) + ")" if c["kernels"]["portable"]
               else "the kernels were NOT the portable ones: tokens may differ between servers")
    lines = ["servers: " + "; ".join(f"{srv} ran {', '.join(us)}" for srv, us in held.items()) + f"; {kernels}"]
    busy = {m: v.get("cpu_busy_other_servers") for m, v in summary.get("modes", {}).items()}
    if any(busy.values()):
        lines.append("other servers' CPU busy over each mode: " + "; ".join(
            f"{m} " + ", ".join(f"{srv} {'unread' if b is None else f'{b:.0%}'}" for srv, b in v.items())
            for m, v in busy.items() if v))
    return lines


def conversation_lines(summary: dict) -> list[str]:
    """One real-text conversation, a short excerpt per turn (runs of a model with a tokenizer)."""
    c = summary.get("conversation")
    if not c:
        return []
    title = f" ({c['title']})" if c.get("title") else ""
    lines = [f"real text: conversation {c['trajectory']}{title} in {c['mode']}, greedy, {len(c['turns'])} turns; "
             "excerpts without the chat template's markup (records.jsonl: every request's prompt_text, output_text)"]
    for t in c["turns"]:
        lines.append(f"  turn {t['turn']}  in:  {t['input']}")
        lines.append(f"  {'':<6} out: {t['output']}")
    return lines


def fault_lines(summary: dict) -> list[str]:
    """A run with --fault: per mode and fault, what it affected and how the cluster came through."""
    rows = [(mode, f) for mode, m in summary["modes"].items() for f in m.get("faults", [])]
    if not rows:
        return []
    out = ["faults (emulated s after the mode's first request; recovery: to the end of the last request it affected)",
           f"  {'mode':<14} {'fault':<28} {'affected':>8} {'completed':>9} {'failed':>6} {'wrong tok':>9} "
           f"{'lost blk':>8} {'recovery s':>10}"]
    for mode, f in rows:
        rec = "-" if f.get("recovery_s") is None else f"{f['recovery_s']:.2f}"
        name = f"{f['kind']}:{f['target']}@{f['at_s']:g}" + ("" if f.get("injected", True) else " (not injected)")
        out.append(f"  {mode:<14} {name:<28} {f['affected']:>8} {f['completed']:>9} {f['failed']:>6} "
                   f"{f['wrong_tokens']:>9} {f['lost_blocks']:>8} {rec:>10}")
        for e in f.get("errors", [])[:2]:
            out.append(f"      error: {e[:160]}")
    return out


def batch_lines(summary: dict) -> list[str]:
    """Per mode, what its prefill passes and decode steps held against the target's HBM."""
    modes = {m: v for m, v in summary["modes"].items() if v.get("prefill_batches") or v.get("decode_batches")}
    if not modes:
        return []

    def one(b: dict | None) -> str:
        if not b:
            return "none"
        r, t = b["requests"], b["tokens"]
        hbm = (f", HBM peak {b['hbm_peak_bytes'] / 1e9:.2f} GB, {b['hbm_limited']} of {b['batches']} full"
               if b.get("hbm_peak_bytes") is not None else "")
        return f"requests {r['p50']}/{r['p90']}/{r['max']}, tokens {t['p50']:,}/{t['p90']:,}/{t['max']:,}{hbm}"

    lines = ["batches (p50/p90/max per pass or step; HBM in target bytes, full: HBM ended the batch)"]
    for mode, m in modes.items():
        lines.append(f"  {mode:<15} prefill {one(m.get('prefill_batches'))}; decode {one(m.get('decode_batches'))}")
    return lines


def _balance_lines(summary: dict) -> list[str]:
    """What the scheduler balances, for the modes that have one."""
    sched = {mode: m for mode, m in summary["modes"].items() if mode.startswith("dualpath")}
    if not sched:
        return []

    def fwd(x: dict | None) -> str:
        if not x:
            return "n/a"
        if not x.get("steps"):
            return "no steps"
        few = f", fewer than {MIN_LOADED}: not a result" if x["steps"] < MIN_LOADED else ""
        return f"{x['median']:.3f} (max {x['max']:.3f}, {x['steps']} steps{few})"

    lines = ["balance: SNIC kv bytes max/avg; PE attention time max/avg per forward step while every PE is "
             "loaded (CPU time of the engines' compute; wall time beside it)"]
    for mode, m in sched.items():
        groups = m.get("scheduler", {}).get("groups", {})
        pulled = sum(g.get("assigned", 0) for g in groups.values())
        lines.append(f"  {mode:<15} SNIC {m['snic_max_over_avg']}  attention {fwd(m['forward_attention_max_over_avg'])}"
                     f"  wall {fwd(m['forward_attention_wall_max_over_avg'])}  passes {m['forward_batches']}, "
                     f"chunked requests {m['chunked_requests']}, paths {m['paths']}"
                     + (f", {pulled} assignments pulled by {len(groups)} group leaders" if groups else ""))
    return lines


