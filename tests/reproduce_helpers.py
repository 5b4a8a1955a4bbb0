"""Hand-built run folders (what `dualpath run` writes) with known answers, for the reproduce tests."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterable

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def is_valid_png(path: Path, min_bytes: int = 5000) -> bool:
    p = Path(path)
    return p.is_file() and p.read_bytes()[:8] == PNG_SIGNATURE and p.stat().st_size >= min_bytes


class RunFolder:
    """Builds one run folder: per mode a summary entry and its records/passes/steps/links."""

    def __init__(self, path: Path, dilation: float = 2.0, topology: str = "1p1d-io"):
        self.path = Path(path)
        self.dilation = dilation
        self.summary = {"command": "hand-built", "target": "qwen2.5-32b on h800", "dilation": dilation,
                        "time": {"dilation": dilation}, "topology": topology, "modes": {}}
        self.rows = {"records": [], "passes": [], "steps": [], "links": []}

    def mode(self, name: str, jct_s: float = 10.0, faithful: bool = True, speedup_bound: float | None = None,
             snic_rates_bps: dict[str, float] | None = None, records: Iterable[dict] = (), passes: Iterable[dict] = (),
             links: Iterable[dict] = ()) -> "RunFolder":
        self.summary["modes"][name] = {
            "faithful": faithful, "unfaithful_reasons": [] if faithful else ["1 of 9 prefill passes overran (hand-built)"],
            "jct_s": jct_s, "jct_testbed_s": jct_s * self.dilation,
            "fidelity": {"storage_nics": [{"nic": n, "rate_bps": r} for n, r in (snic_rates_bps or {}).items()]}}
        if speedup_bound is not None:
            self.summary["modes"][name]["speedup_bound"] = speedup_bound
        for kind, rows in (("records", records), ("passes", passes), ("links", links)):
            self.rows[kind] += [{"mode": name, **r} for r in rows]
        return self

    def write(self, plan: dict | None = None, aps: float | None = None) -> Path:
        self.path.mkdir(parents=True, exist_ok=True)
        if aps is not None:
            self.summary["arrivals"] = {"aps": aps, "seed": 0}
        (self.path / "summary.json").write_text(json.dumps(self.summary))
        for kind, rows in self.rows.items():
            with open(self.path / f"{kind}.jsonl", "w") as f:
                for r in rows:
                    f.write(json.dumps(r) + "\n")
        if plan is not None:
            (self.path / "plan.json").write_text(json.dumps(plan))
        return self.path


def plan_json(cfg) -> dict:
    return {"key": cfg.key, "digest": cfg.digest(), "config": cfg.to_dict()}


def runs_for_plan(root: Path, plan, jct: Callable[[object, str], float], unfaithful: set[str] = frozenset(),
                  bound: Callable[[object], float | None] = lambda cfg: None) -> Path:
    """One hand-built folder per config of `plan` (configs of one digest share it), JCT per mode
    from jct(cfg, mode); configs whose key is in `unfaithful` get an UNFAITHFUL basic."""
    done = set()
    for cfg in plan.configs:
        if cfg.digest() in done:
            continue
        done.add(cfg.digest())
        f = RunFolder(Path(root) / cfg.folder(), topology=cfg.topology)
        for m in cfg.modes:
            f.mode(m, jct_s=jct(cfg, m), faithful=not (cfg.key in unfaithful and m == "basic"), speedup_bound=bound(cfg))
        f.write(plan=plan_json(cfg))
    return Path(root)


def record(traj: int, turn: int, arrive: float, ttft: float, tpot: float | None = 0.04, read: float = 0.0,
           done: float | None = None, dilation: float = 2.0, error: str = "") -> dict:
    """A request whose times (testbed s) follow from arrive and the emulated ttft/read."""
    t_first = arrive + ttft * dilation
    rstart = arrive + 0.1 * ttft * dilation if read else 0.0
    pstart = (rstart + read * dilation) if read else arrive + 0.5 * ttft * dilation
    return {"request": f"t{traj}-r{turn}", "trajectory": traj, "turn": turn, "t_arrive": arrive,
            "t_read_start": rstart, "t_read_end": pstart if read else 0.0, "t_prefill_start": pstart,
            "t_first_token": t_first, "t_done": done if done is not None else t_first + 1.0, "ttft_s": ttft,
            "ttst_s": ttft + 0.05, "tpot_s": tpot, "error": error}


def online_run(path: Path, aps: float, rising: dict[str, bool], n: int = 60, dilation: float = 2.0) -> RunFolder:
    """n single-turn agents arriving 1/aps emulated s apart, per mode; a mode over its capacity
    (rising[mode]) sees its TTFT climb from 0.5 to 3.5 s (a growing queue), else a flat 0.5 s.
    Basic's read is 0.3 x its TTFT, DualPath's a flat 0.1 s; each agent ends 2 s after its first token."""
    f = RunFolder(path, dilation=dilation)
    for mode, up in rising.items():
        rows = []
        for i in range(n):
            ttft = (0.5 + 3.0 * i / n) if up else 0.5
            rows.append(record(i, 0, arrive=i / aps * dilation, ttft=ttft,
                               read=0.3 * ttft if mode == "basic" else 0.1, dilation=dilation))
            rows[-1]["t_done"] = rows[-1]["t_first_token"] + 2.0 * dilation
        f.mode(mode, jct_s=50.0, records=rows)
    return f


HEADLINE_KEYS = {"name", "testbed", "paper", "bound", "n", "ci95", "ci_method", "interval"}  # a summary's headline entry
