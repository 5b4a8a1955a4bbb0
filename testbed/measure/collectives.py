"""The collectives a run's forward passes waited for: gathered from its passes and steps (pure).

Each prefill pass record (the conductor's `batches`, passes.jsonl) carries its engine's
`timing.collective_log`, and each decode step record (steps.jsonl) its `collective_log`: one
entry per layer, {t, s, tokens, sent, received} in testbed seconds and bytes
(dualpath/engines/collective.py). `collective_rows` flattens them, `collective_stats`
summarises them in the summary's units: latencies in emulated seconds (testbed / dilation),
with testbed seconds beside them.
"""
from __future__ import annotations

from typing import Any, Iterable

from testbed.measure.metrics import percentiles

PS = (50, 90, 99)


def collective_rows(passes: Iterable[dict], steps: Iterable[dict]) -> list[dict[str, Any]]:
    """One row per collective: role ("prefill"/"decode"), engine, and its log entry."""
    rows = []
    for b in passes:
        for c in (b.get("timing") or {}).get("collective_log") or ():
            rows.append({"role": "prefill", "engine": b.get("pe"), **c})
    for x in steps:
        for c in x.get("collective_log") or ():
            rows.append({"role": "decode", "engine": x.get("de"), **c})
    return rows


def latency_percentiles(rows: Iterable[dict], dilation: float) -> dict[str, Any]:
    """p50/p90/p99 of the rows' latencies: emulated seconds, and testbed seconds beside."""
    lat = [r["s"] for r in rows]
    tb = percentiles(lat, PS)
    return {**{k: (round(v / dilation, 9) if v is not None else None) for k, v in tb.items()},
            "testbed_s": tb, "n": len(lat)}


def collective_stats(passes: Iterable[dict], steps: Iterable[dict], dilation: float) -> dict[str, Any] | None:
    """The summary's `collectives` block of a mode, or None if it ran none."""
    rows = collective_rows(passes, steps)
    if not rows:
        return None
    out: dict[str, Any] = {"count": len(rows), "sent_bytes": sum(r["sent"] for r in rows),
                           "received_bytes": sum(r["received"] for r in rows),
                           "latency_s": latency_percentiles(rows, dilation)}
    for role in ("prefill", "decode"):
        mine = [r for r in rows if r["role"] == role]
        if mine:
            out[role] = {"count": len(mine), "mean_tokens": round(sum(r["tokens"] for r in mine) / len(mine), 2),
                         "latency_s": latency_percentiles(mine, dilation)}
    return out
