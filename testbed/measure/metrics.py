"""Per-request latencies from token timestamps, and their percentiles (pure arithmetic).

For a request that arrived at `t_arrive` and produced tokens at `token_times` (the first one at
the end of its prefill, the others at the end of the decode steps that made them):
- TTFT, time to first token: token_times[0] - t_arrive;
- TTST, time to second token: token_times[1] - t_arrive. The paper reports it apart from TTFT
  because the second token waits for the prefill-to-decode KV transfer;
- TPOT, time per output token: the mean gap between consecutive tokens after the second,
  (token_times[-1] - token_times[1]) / (n - 2), so that the P->D transfer sits in TTST only.
Requests with too few tokens have no TTST (1 token) or TPOT (< 3 tokens).
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

PERCENTILES = (50, 90, 99)


def token_latencies(t_arrive: float, token_times: Sequence[float]) -> dict[str, float | None]:
    """{"ttft", "ttst", "tpot"} of one request, in the units of its timestamps."""
    n = len(token_times)
    if any(b < a for a, b in zip(token_times, token_times[1:])) or (n and token_times[0] < t_arrive):
        raise ValueError(f"token times must not decrease and must follow the arrival ({t_arrive}): {list(token_times)[:5]}")
    return {"ttft": token_times[0] - t_arrive if n else None,
            "ttst": token_times[1] - t_arrive if n >= 2 else None,
            "tpot": (token_times[-1] - token_times[1]) / (n - 2) if n >= 3 else None}


def percentiles(values: Iterable[float | None], ps: Sequence[int] = PERCENTILES,
                scale: float = 1.0) -> dict[str, float | None]:
    """{"p50": ..., "p90": ..., "p99": ...} of the non-None values times `scale`, by linear
    interpolation between closest ranks (numpy's default); None for each when there are none."""
    xs = sorted(v * scale for v in values if v is not None)
    out: dict[str, float | None] = {}
    for p in ps:
        if not xs:
            out[f"p{p}"] = None
            continue
        pos = (len(xs) - 1) * p / 100
        lo, hi = math.floor(pos), math.ceil(pos)
        out[f"p{p}"] = round(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo), 6)
    return out


def busy_time(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of [start, end] intervals."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted((s, e) for s, e in intervals if e > s):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def chain_bound_s(turns: dict[Any, list[tuple[float, float, float]]], read_bytes_per_s: float) -> float | None:
    """The least JCT any read schedule allows an agentic workload (in the times given): an agent's
    turns run one after another, and a turn reads its hit KV from storage into a DRAM buffer
    before its prefill starts (layerwise overlaps the buffer-to-HBM copy with compute, not this
    read), so it lasts at least that read at the uncontended storage rate, plus its prefill and
    its decode. `turns` maps each agent to its turns' (hit bytes, prefill s, decode s), the
    compute times without I/O (the oracle's)."""
    if not turns or read_bytes_per_s <= 0:
        return None
    return max(sum(h / read_bytes_per_s + pre + dec for h, pre, dec in ts) for ts in turns.values())


def speedups(modes: dict[str, dict], p: int, d: int, chain_s: float | None = None) -> None:
    """speedup_over_basic per mode, and the bound it is judged against, the least of:
      * nodes: (P+D)/P, the SNIC bound of reading on every node instead of the prefill nodes only;
      * io_free: basic/oracle, the most that removing all I/O could give;
      * chain: basic/`chain_s` (chain_bound_s, in the modes' time): at light load an agent's own
        chain of reads and computes, not the cluster's bandwidth, is what JCT cannot beat.
    `speedup_bounds` gives each and `speedup_bound_by` the one that binds."""
    basic = modes.get("basic")
    if not basic or not basic["jct_s"]:
        return
    bounds = {"nodes": (p + d) / p}
    oracle = modes.get("oracle")
    if oracle and oracle["jct_s"]:
        bounds["io_free"] = basic["jct_s"] / oracle["jct_s"]
    if chain_s:
        bounds["chain"] = basic["jct_s"] / chain_s
    by = min(bounds, key=bounds.get)
    for m in modes.values():
        m["speedup_over_basic"] = round(basic["jct_s"] / m["jct_s"], 4) if m["jct_s"] else None
        m["speedup_bound"] = round(bounds[by], 4)
        m["speedup_bounds"] = {k: round(v, 4) for k, v in bounds.items()}
        m["speedup_bound_by"] = by


MIN_LOADED = 20  # windows or steps behind a per-window headline, at least (DESIGN §9); fewer: not a result


def forward_balance(batches: list[dict], key: str = "attention_s", loaded_only: bool = True) -> dict[str, Any] | None:
    """Attention time max/avg across PEs per forward step.

    Step k is each PE's k-th forward pass (data-parallel engines step together in the
    paper). With `loaded_only`, a step counts only when every PE's k-th pass was loaded:
    work was left for its next pass, so the compute quota, not an empty queue, ended it
    (the paper measures while engines are loaded, early in a run). Median and max over the
    counted steps, and how many there were.
    """
    per: dict[str, list[dict]] = {}
    for b in batches:
        per.setdefault(b["pe"], []).append(b)
    if len(per) < 2:
        return None
    ratios = []
    for k in range(min(len(v) for v in per.values())):
        step = [v[k] for v in per.values()]
        if loaded_only and not all(b["loaded"] for b in step):
            continue
        vals = [b[key] for b in step]
        mean = sum(vals) / len(vals)
        if mean > 0:
            ratios.append(max(vals) / mean)
    if not ratios:
        return {"steps": 0}
    ratios.sort()
    return {"steps": len(ratios), "median": round(ratios[len(ratios) // 2], 3), "max": round(ratios[-1], 3)}


def batch_sizes(records: list[dict]) -> dict[str, Any] | None:
    """The distribution of a mode's batches (prefill passes or decode steps): requests and tokens
    per batch at p50, p90 and max, the most HBM one held (target bytes) and how many HBM filled."""
    if not records:
        return None

    def q(xs: list[int], p: float) -> int:
        return xs[min(len(xs) - 1, int(p * len(xs)))]

    n, tok = sorted(r["n"] for r in records), sorted(r.get("batch_tokens", 0) for r in records)
    peak = [r["hbm_peak_bytes"] for r in records if r.get("hbm_peak_bytes") is not None]
    return {"batches": len(records), "requests": {"p50": q(n, 0.5), "p90": q(n, 0.9), "max": n[-1]},
            "tokens": {"p50": q(tok, 0.5), "p90": q(tok, 0.9), "max": tok[-1]},
            "hbm_peak_bytes": max(peak) if peak else None,
            "hbm_limited": sum(bool(r.get("hbm_limited")) for r in records)}
