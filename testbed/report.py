"""Human-readable check summaries and the files a run leaves in results/."""
from __future__ import annotations

import json
from pathlib import Path

from testbed.check import RATE_OK, MODEL_KEEP_OK, CheckReport


def _mbit(bps: float) -> str:
    return f"{bps / 1e6:7.1f}"


def check_lines(r: CheckReport) -> list[str]:
    lines = [f"link calibration ({r.topology}): wire rate from HTB counters vs configured, "
             f"accepted {RATE_OK[0]}-{RATE_OK[1]}",
             f"  {'nic':<10} {'dir':<3} {'class':<6} {'config':>7} {'wire':>7} {'ratio':>6} "
             f"{'goodput':>7} {'cpu':>4}  Mbit/s"]
    for l in r.links:
        lines.append(f"  {l.nic_kind:<10} {l.direction:<3} {l.traffic_class:<6} {_mbit(l.configured_bps)} "
                     f"{_mbit(l.wire_bps)} {l.ratio:6.3f} {_mbit(l.goodput_bps)} {l.cpu_busy:4.0%}"
                     f"  {'ok' if l.ok else 'FAIL: ' + l.note}")
    m = r.marking
    if m:
        lines.append(f"dscp by port: flow to kv port {m['kv_range_port']['port']} -> "
                     f"{m['kv_range_port']['kv_class_share']:.1%} in the kv class; flow to port "
                     f"{m['other_port']['port']} -> {m['other_port']['model_class_share']:.1%} in the model class")
    for p in r.priority:
        lines.append(f"priority, QoS {'on ' if p.qos else 'off'}: model flow kept {p.kept_ratio:.3f} of "
                     f"{p.model_offered_bps / 1e6:.0f} Mbit/s (loss {p.model_lost_percent:.1f} %) beside a kv "
                     f"flood of {p.kv_goodput_bps / 1e6:.0f} Mbit/s; cpu {p.cpu_busy:.0%}")
    if len(r.priority) == 2:
        lines.append(f"  (QoS on must keep >= {MODEL_KEEP_OK}; QoS off must lose more than QoS on)")
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
