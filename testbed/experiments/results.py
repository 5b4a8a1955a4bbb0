"""What a run leaves: each mode's summary (JCT, TTFT/TPOT, bytes per NIC, fidelity, checks), the real-text excerpt, and the files under results/<experiment>/<run>/."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from dualpath.accounting import RequestBytes, request_bytes
from dualpath.kv.spans import kv_bytes
from dualpath.kv.layouts import BlockGeometry
from dualpath.traffic_classes import MODEL
from dualpath.workload import Workload
from testbed.fabric import counters
from testbed.measure.collectives import collective_stats
from dualpath.lifecycle.record import RequestRecord
from testbed.cluster.faults import FaultLog
from testbed.measure.fidelity import payload_share
from testbed.measure.metrics import batch_sizes, chain_bound_s, forward_balance, percentiles, speedups, token_latencies
from testbed.paths import REPO
from testbed.cluster.runclock import RunClock
from testbed.topology import Topology


TOLERANCE = 0.02  # measured KV bytes per NIC vs the per-path counts


@dataclass
class ModeResult:
    mode: str
    records: list[RequestRecord]
    jct_s: float
    counters: counters.Snapshot
    control_app_bytes: int
    cpu_busy: float
    cpu_peak: float
    accounting: list = field(default_factory=list)
    verdicts: dict[str, Any] = field(default_factory=dict)
    transport: str = ""  # as the node processes reported it
    batches: list = field(default_factory=list)  # PE forward passes
    scheduler: dict = field(default_factory=dict)  # the router's own record (service, leaders' pulls)
    steps: list = field(default_factory=list)  # decode steps of every DE
    samples: list = field(default_factory=list)  # the monitor's time series: CPU and every NIC's bytes
    links: list = field(default_factory=list)  # fidelity.LinkUse of every storage NIC
    agent_jct_s: list = field(default_factory=list)  # per agent: its last turn's end - its arrival (testbed s)
    cpu_own: float = 0.0  # of cpu_busy, the testbed's own processes
    cpu_steal: float = 0.0  # of cpu_busy, what the hypervisor took (a contended host)
    cpu_threads: list = field(default_factory=list)  # where cpu_own went: the busiest threads
    server_cpu: dict = field(default_factory=dict)  # each other server: its busy share over the run (None: unread)
    clock_sync: dict = field(default_factory=dict)  # each other server: its clock's offset and uncertainty
    faithful: bool = False
    unfaithful_reasons: list = field(default_factory=list)
    fidelity_notes: list = field(default_factory=list)  # overruns within the allowance (testbed/measure/fidelity.py)
    dscp: dict = field(default_factory=dict)  # per namespace, bytes and packets it sent per DSCP class
    counters_s: float = 0.0  # testbed seconds between the counters' two snapshots
    rdma: dict | None = None  # transport rdma: the rxe counters' proof (dualpath.transport.rdma.prove)
    fault_log: FaultLog | None = None  # a run with --fault: what each fault did
    lost: dict = field(default_factory=dict)  # fault label -> blocks acknowledged before it that did not read back
    wrong_tokens: dict = field(default_factory=dict)  # request -> generated tokens unlike recomputation


def _request_bytes(r: RequestRecord, mode: str) -> RequestBytes:
    # "none": the request moved no KV (an oracle plan), whatever its mode is named (the isolation
    # experiment's conditions are oracle passes named idle, qos_on, qos_off)
    path = "oracle" if mode == "oracle" or r.path == "none" else r.path
    return RequestBytes(path, r.hit_bytes, r.miss_bytes, r.writeback_bytes, r.pe_node, r.de_node,
                        pe_engine=r.pe, de_engine=r.de, h_pe=r.pe_hit_bytes if path == "split" else None,
                        R=r.chunk_read_bytes, Rd=r.reread_bytes)


def summarize(results: list[ModeResult], workload: Workload, geom: BlockGeometry, topo: Topology) -> dict[str, Any]:
    """summary.json: per mode, the verdict first, then times in emulated seconds (testbed
    seconds beside them), correctness, bytes per NIC and balance."""
    clock = RunClock.of(topo, geom)
    # the run's verdict comes first: a run is a result only when every mode in it is FAITHFUL
    out: dict[str, Any] = {"faithful": False, "unfaithful_modes": [], "target": clock.target, "dilation": round(clock.dilation, 6), "time": clock.to_dict(),
                           "modes": {}}
    k = clock.dilation
    for res in results:
        out["modes"][res.mode] = _mode_summary(res, geom, k)
        coll = collective_stats(res.batches, res.steps, k)
        if coll is not None:  # only a topology with `collectives: on` has this block
            coll["model_class_tx_bytes"] = sum(v[MODEL.name][0] for v in res.dscp.values())
            out["modes"][res.mode]["collectives"] = coll
    for res in results:
        if res.fault_log is not None:
            m = out["modes"][res.mode]
            m["faults"] = res.fault_log.summary(res.records, res.wrong_tokens, res.lost, k)
            m["faults_unattributed"] = res.fault_log.unattributed[:20]
            m["kv_bytes_vs_expected"]["note"] = ("a run with faults: bytes of attempts that were retried and of "
                                                 "reads that were discarded are not in the expected counts")
    out["unfaithful_modes"] = [m for m, v in out["modes"].items() if not v["faithful"]]
    out["faithful"] = bool(out["modes"]) and not out["unfaithful_modes"]
    chain = run_chain_s(results, topo)
    speedups(out["modes"], topo.spec.prefill_nodes, topo.spec.decode_nodes, chain / k if chain else None)
    proofs = [r.rdma for r in results if r.rdma is not None]
    if proofs:  # transport rdma: proven only when every mode that moved KV proved it
        out["rdma"] = {"rdma_proven": all(p["rdma_proven"] for p in proofs),
                       "rxe_sent_pkts": sum(p["rxe_sent_pkts"] for p in proofs),
                       "rxe_rcvd_pkts": sum(p["rxe_rcvd_pkts"] for p in proofs),
                       "kv_bytes": sum(p["kv_bytes"] for p in proofs),
                       "rdma_mtu": None, "modes": [r.mode for r in results if r.rdma is not None]}
    return out


def run_chain_s(results: list[ModeResult], topo: Topology) -> float | None:
    """chain_bound_s of a run, testbed s: the oracle mode's own turn times (routing to first
    token, first token to done) stand in for compute without I/O, and each turn's hits are read
    at one SNIC's uncontended payload rate (both sides' SNICs where a mode split a read), the
    storage servers' NICs and disks together no slower. None without an oracle mode."""
    oracle = next((r for r in results if r.mode == "oracle"), None)
    if oracle is None:
        return None
    turns: dict[int, list[tuple[float, float, float]]] = {}
    for r in sorted(oracle.records, key=lambda r: (r.trajectory, r.turn)):
        if not r.error and r.trajectory >= 0 and r.token_times:  # warm-ups are not an agent's
            turns.setdefault(r.trajectory, []).append((r.hit_bytes, r.t_first_token - r.t_arrive,
                                                       r.t_done - r.t_first_token))
    sides = 2 if any(x.path == "split" for res in results for x in res.records) else 1
    wire, n = payload_share(topo.spec.mtu), topo.spec.storage.servers
    rate = min(sides * topo.snic_bps * wire, n * topo.storage_nic_bps * wire, n * topo.disk_bps) / 8
    return chain_bound_s(turns, rate)


def _mode_summary(res: ModeResult, geom: BlockGeometry, k: float) -> dict[str, Any]:
    """One mode's block of summary.json (times in emulated seconds: testbed seconds / k)."""
    ok = [r for r in res.records if not r.error]
    lat = [token_latencies(r.t_arrive, r.token_times) for r in ok if r.token_times]
    hit = sum(r.n_hit for r in ok)
    prompt = sum(r.n_prompt for r in ok)
    resent = res.counters.kv_resent
    per_nic = _per_nic(res.accounting, resent)
    snic_rx = [v for (owner, kind, d), v in res.counters.kv_payload.items() if kind == "snic" and d == "rx"]
    pe_att: dict[str, float] = {}
    for r in ok:
        pe_att[r.pe] = pe_att.get(r.pe, 0.0) + r.attention_s
    acc_bad = [r for r in per_nic if not r["ok"]]
    peaks = [r.peak_hit_bytes / (kv_bytes(geom, r.n_hit) // geom.n_layer) for r in ok if r.n_hit and r.peak_hit_bytes]
    return {
        "faithful": res.faithful, "unfaithful_reasons": res.unfaithful_reasons,
        "fidelity_notes": res.fidelity_notes,
        "requests": len(res.records), "errors": len(res.records) - len(ok),
        "first_error": next(({"request": r.request, "error": " ".join(str(r.error).split())[:300]}
                             for r in res.records if r.error), None),
        "jct_s": round(res.jct_s / k, 4), "jct_testbed_s": round(res.jct_s, 3),
        # per agent, arrival to its last turn's end: the online figures' JCT (offline, all arrive at once)
        "agent_jct_s": {"mean": round(sum(res.agent_jct_s) / len(res.agent_jct_s) / k, 4) if res.agent_jct_s else None,
                        **percentiles(res.agent_jct_s, scale=1 / k)},
        "ttft_s": percentiles((x["ttft"] for x in lat), scale=1 / k),
        "ttst_s": percentiles((x["ttst"] for x in lat), scale=1 / k),
        "tpot_s": percentiles((x["tpot"] for x in lat), scale=1 / k),
        "hit_rate": round(hit / prompt, 4) if prompt else 0,
        "paths": {p: sum(r.path == p for r in ok) for p in ("pe", "de", "split", "none")},
        # the classes that moved KV, as the engines report them: a plug-in shows here by name
        "connectors": {side: sorted({r.connectors[i] for r in ok if r.connectors[i]})
                       for i, side in enumerate(("prefill", "decode"))},
        "verification": res.verdicts,
        **({"rdma": res.rdma} if res.rdma is not None else {}),
        "peak_hit_kv_layers_in_hbm": {"max": round(max(peaks), 2) if peaks else 0,
                                      "mean": round(sum(peaks) / len(peaks), 2) if peaks else 0},
        "kv_bytes_vs_expected": {
            "tolerance": TOLERANCE, "nics": len(per_nic), "within": len(per_nic) - len(acc_bad),
            "per_nic": per_nic,
            # measured: first sends only; resent: what TCP sent again, taken off the HTB count
            "per_direction": [{"nic": "/".join(row.nic), "dir": row.direction, "expected": row.expected,
                               "measured": row.measured, "overhead": row.measured - row.expected,
                               "resent": resent.get((*row.nic, row.direction), 0)}
                              for row in res.accounting]},
        "control_bytes": {"model_class_on_nics": sum(res.counters.model_wire.values()),
                          "messages_at_conductor": res.control_app_bytes},
        "drops": sum(res.counters.drops.values()),
        # segments sent again, per namespace: each one's bytes are in the HTB counters twice
        "tcp_retransmitted_segments": {ns: n for ns, n in sorted(res.counters.retransmitted.items()) if n},
        "reread_bytes": sum(r.reread_bytes for r in ok),
        # a mode that reads nothing (oracle) has no balance: its SNICs' payload is noise around 0
        "snic_max_over_avg": (round(max(snic_rx) / (sum(snic_rx) / len(snic_rx)), 3)
                              if sum(snic_rx) > 0 and any(r.path != "none" for r in ok) else None),
        "attention_max_over_avg": (round(max(pe_att.values()) / (sum(pe_att.values()) / len(pe_att)), 3)
                                   if pe_att and sum(pe_att.values()) else None),
        # per forward step across PEs: while loaded (the target), by wall time, and every step
        "forward_attention_max_over_avg": forward_balance(res.batches),
        "forward_attention_wall_max_over_avg": forward_balance(res.batches, "attention_wall_s"),
        "forward_attention_all_steps": forward_balance(res.batches, loaded_only=False),
        "forward_batches": len(res.batches),
        "chunked_requests": sum(r.passes > 1 for r in ok),
        "retried_requests": sum(r.attempts > 1 for r in res.records),
        "scheduler": res.scheduler,
        **_batch_keys(res),
        "cpu_busy": round(res.cpu_busy, 3), "cpu_peak_1s": round(res.cpu_peak, 3),
        # the testbed's processes; the rest of cpu_busy is the kernel's NIC emulation (softirq)
        # and whatever else ran on the machine
        "cpu_testbed_processes": round(res.cpu_own, 3),
        "cpu_steal": round(res.cpu_steal, 3),
        **({"cpu_busy_other_servers": res.server_cpu, "clock_other_servers": res.clock_sync} if res.server_cpu else {}),
        "fidelity": {"prefill_passes": len(res.batches),
                     "prefill_overran": sum(bool(b["timing"]["overran"]) for b in res.batches),
                     "decode_steps": len(res.steps), "decode_overran": sum(bool(x["overran"]) for x in res.steps),
                     "mean_decode_batch": round(sum(x["n"] for x in res.steps) / len(res.steps), 2) if res.steps else None,
                     "late_testbed_s": round(late := sum(b["timing"]["late_s"] for b in res.batches)
                                             + sum(x["late_s"] for x in res.steps), 4),
                     "late_share_of_jct": round(late / res.jct_s, 5) if res.jct_s else None,
                     "storage_nics": [u.to_dict() for u in res.links],
                     "cpu_by_thread": res.cpu_threads},
    }


def _batch_keys(res: ModeResult) -> dict[str, Any]:
    """A mode's batches: the mean pass size, and what each pass and decode step held against the
    target's HBM (DESIGN 3a)."""
    return {"mean_batch_size": round(sum(b["n"] for b in res.batches) / len(res.batches), 2) if res.batches else None,
            "prefill_batches": batch_sizes(res.batches), "decode_batches": batch_sizes(res.steps)}


def _per_nic(rows, resent: dict[tuple[str, str, str], int]) -> list[dict[str, Any]]:
    """Both directions of each NIC together, judged against TOLERANCE, with the bytes TCP
    re-sent over it (already taken off `measured`).

    Per direction, a NIC that mostly receives also sends the transport's requests and
    the store's request frames for what it receives (a few hundred bytes per transfer):
    next to a small expected count that is many percent. Over both directions it is well
    under one; the per-direction rows keep it visible as protocol overhead.
    """
    nics: dict[tuple, list[int]] = {}
    for row in rows:
        e = nics.setdefault(tuple(row.nic), [0, 0, 0])
        e[0] += row.expected
        e[1] += row.measured
        e[2] += resent.get((*row.nic, row.direction), 0)
    out = []
    for nic, (exp, meas, again) in nics.items():
        ratio = meas / exp if exp else (1.0 if meas == 0 else float("inf"))
        out.append({"nic": "/".join(nic), "expected": exp, "measured": meas, "resent": again,
                    "ratio": round(ratio, 4) if exp else None,
                    "ok": abs(ratio - 1) <= TOLERANCE if exp else meas < 64 << 10})
    return out


def interfaces_of(r: RequestRecord, mode: str) -> dict[str, int]:
    """The interfaces that carried this request's KV, with bytes per direction, by the path definition.

    Keys name the emulated NIC (the node's or engine's namespace, its kind) and the direction
    in that NIC's view, e.g. "dpt-d0/snic/rx".
    """
    if r.error:
        return {}
    owner = {"pe": r.pe_node, "de": r.de_node, "storage": "storage"}
    out: dict[str, int] = {}
    for (nic, direction), n in request_bytes(_request_bytes(r, mode)).items():
        if n:
            who = (r.pe if nic.side == "pe" else r.de) if nic.kind == "cnic" else owner[nic.side]
            out[f"{who}/{nic.kind}/{direction}"] = n
    return out


def _decoder(checkpoint: str | Path | None) -> Callable[..., str] | None:
    """ids -> text with the checkpoint's tokenizer (special tokens kept unless `skip`), or None
    for a model without one. A relative path is the repository's (see shown_path)."""
    from dualpath.workload.text import tokenizer_or_none

    if checkpoint is not None and not Path(checkpoint).is_absolute():
        checkpoint = REPO / checkpoint
    tok = tokenizer_or_none(checkpoint)
    if tok is None:
        return None
    return lambda ids, skip=False: tok.decode(list(ids), skip_special_tokens=skip)


EXCERPT_CHARS = 110  # per turn and side, in the report's conversation


def _excerpt(text: str, chars: int = EXCERPT_CHARS) -> str:
    one = " ".join(text.split())
    return one if len(one) <= chars else one[:chars - 1] + "…"


def conversation(results: list[ModeResult], checkpoint: str | Path, workload: Workload) -> dict[str, Any] | None:
    """One conversation's text as the run produced it (summary.json's `conversation`, the
    report's excerpt): per turn, what was added to the context (the user's task or the tool
    output, without the chat template's special tokens) and what the model answered. From the
    dualpath mode (else the first that moves KV), the lowest trajectory that completed; None
    for a model without a tokenizer."""
    decode = _decoder(checkpoint)
    if decode is None or not results:
        return None
    res = (next((r for r in results if r.mode == "dualpath"), None)
           or next((r for r in results if r.mode != "oracle"), results[0]))
    recs = sorted((r for r in res.records if r.trajectory >= 0), key=lambda r: (r.trajectory, r.turn))
    done = sorted({r.trajectory for r in recs} - {r.trajectory for r in recs if r.error})
    if not done:
        return None
    tid = done[0]
    turns, before = [], list(workload.system_prompt)
    for r in (x for x in recs if x.trajectory == tid):
        new = r.prompt[len(before):] if r.prompt[:len(before)] == before else r.prompt
        turns.append({"turn": r.turn, "input": _excerpt(decode(new, skip=True)),
                      "output": _excerpt(decode(r.tokens, skip=True))})
        before = list(r.prompt) + list(r.tokens)
    title = next((getattr(t, "title", "") for t in workload.trajectories if t.id == tid), "")
    return {"mode": res.mode, "trajectory": tid, "title": title, "turns": turns}


def write_results(results: list[ModeResult], summary: dict[str, Any], run_dir: Path, command: str) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "summary.json").write_text(json.dumps({"command": command, **summary}, indent=2) + "\n")
    k = summary.get("dilation", 1.0)
    # With a tokenizer, every record carries its prompt and output as text, decoded here once
    # (records keep no prompt ids: the text is the prompt's one copy)
    decode = _decoder(summary.get("checkpoint"))
    with open(run_dir / "records.jsonl", "w") as f:
        for res in results:
            for r in res.records:
                lat = token_latencies(r.t_arrive, r.token_times) if r.token_times else {}
                emulated = {f"{name}_s": (round(v / k, 6) if v is not None else None) for name, v in lat.items()}
                text = {"prompt_text": decode(r.prompt), "output_text": decode(r.tokens)} if decode else {}
                f.write(json.dumps({**r.to_json(), **emulated, "interfaces": interfaces_of(r, res.mode), **text}) + "\n")
    # the engines' own time series: every prefill pass and decode step (testbed seconds)
    with open(run_dir / "passes.jsonl", "w") as f:
        for res in results:
            for b in res.batches:
                f.write(json.dumps({"mode": res.mode, **b}) + "\n")
    with open(run_dir / "steps.jsonl", "w") as f:
        for res in results:
            for x in res.steps:
                f.write(json.dumps({"mode": res.mode, **x}) + "\n")
    with open(run_dir / "links.jsonl", "w") as f:  # per NIC: [rx, tx] bytes so far, in its own view
        for res in results:
            for x in res.samples:
                f.write(json.dumps({"mode": res.mode, **x}) + "\n")
