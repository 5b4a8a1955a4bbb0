"""The paper's models on the paper's clusters, in the simulator: the cells of a figure's grid that
the testbed cannot run here.

The paper runs DS 660B on 2P4D, DS 27B on 1P1D and Qwen2.5-32B on 1P2D, its nodes 8 H800s with a
400 Gbit/s CNIC each and one 400 Gbit/s SNIC (scale.paper_cluster). One 2-core host runs one
small cluster of one target at lengths / 32; every other cell is simulated here, in the target's
own units (its lengths, rates and GPU times; the simulator without the testbed host's latencies,
as table3's). Every such cell says `source: simulated` and carries the simulator's committed
validation (`validation()`): its error against FAITHFUL testbed runs, which is the only check it
has; no testbed run exists at these lengths and sizes.

Scale-down, stated: the paper's agent counts (DS 660B 512 to 4096) make hundreds of thousands
of requests per mode, more than this host simulates in an id's hour (about 600 requests per wall
second), so the cells have AGENTS_PER_PE_NODE agents per prefill node (DS 660B twice DS 27B's
and Qwen's, as in the paper). At these counts an agent's own chain of turns can bound the JCT
more than the storage NICs do; the speed-up is then smaller than at the paper's counts (DS 27B
64K, simulated: 1.19x at 64 agents, 1.63x at 128, 1.89x at 256; the paper: 1.78x at 1024).

Qwen2.5-32B, served as the paper says (data parallelism only: a full BF16 copy of its 65.5 GB of
weights per H800), has 6.47 GB of HBM for KV, 24,689 tokens: every trace set has contexts past
that, which no engine can hold, so its simulated cells fail those requests and report it instead
of a JCT. The paper does not say how its Qwen contexts fit; nothing here assumes a deployment it
did not state.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

REPO = Path(__file__).resolve().parents[2]
VALIDATIONS = REPO / "results" / "sim" / "validate"
AGENTS_PER_PE_NODE = {True: (64,), False: (64, 256)}  # --quick, full: one cell per count
MODES = ("basic", "dualpath", "oracle")


@dataclass(frozen=True)
class PaperRow:
    label: str  # the paper's name for the model
    model: str  # emulators.gpu.models name
    prefill_nodes: int
    decode_nodes: int

    @property
    def cluster(self) -> str:
        return f"{self.prefill_nodes}P{self.decode_nodes}D"

    def agents(self, quick: bool) -> tuple[int, ...]:
        return tuple(n * self.prefill_nodes for n in AGENTS_PER_PE_NODE[quick])


PAPER_ROWS = (PaperRow("DS 660B", "deepseek-v3.2", 2, 4), PaperRow("DS 27B", "ds-27b", 1, 1),
              PaperRow("Qwen2.5-32B", "qwen2.5-32b", 1, 2))
MAXLENS = ("32K", "48K", "64K")


def simulate_cell(row: PaperRow, maxlen: str, agents: int, modes: Sequence[str] = MODES) -> dict[str, Any]:
    """One grid cell in the simulator: the trace set `maxlen` at the paper's lengths, `agents`
    agents at once, every mode on the paper's cluster of `row`. JCTs in the target's seconds."""
    from simulator.calibration import UNCALIBRATED
    from testbed.reproduce.plan import WorkloadSpec
    from testbed.reproduce.scale import paper_cluster
    from testbed.sim.drive import sim_config, simulate, trajectories

    cfg = sim_config(paper_cluster(row.prefill_nodes, row.decode_nodes, row.model), units="target", cal=UNCALIBRATED)
    trajs = trajectories(WorkloadSpec(preset=maxlen, scale=1, agents=agents).config(), cfg.dilation)
    t = time.perf_counter()
    res = simulate(cfg, trajs, list(modes))
    failed = [x for r in res.values() for x in r.records if x.error]
    # a cell whose requests failed (a context the target's HBM cannot hold) has no JCT to compare
    jct = {m: (r.jct_s / cfg.dilation if not failed else None) for m, r in res.items()}
    return {"model": row.label, "cluster": row.cluster, "maxlen": maxlen, "agents": agents, "jct_s": jct,
            "speedup": _ratio(jct.get("basic"), jct.get("dualpath")),
            "dualpath_over_oracle": _ratio(jct.get("dualpath"), jct.get("oracle")),
            "requests": sum(len(r.records) for r in res.values()), "failed": len(failed),
            "failure": failed[0].error if failed else None, "sim_wall_s": round(time.perf_counter() - t, 1),
            "source": "simulated", "faithful": None}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def validation(root: Path = VALIDATIONS) -> dict[str, Any] | None:
    """The newest committed `dualpath sim --validate`: its mean and max JCT error against the
    testbed runs it names, and where it is; None without one."""
    found = sorted(root.glob("*/summary.json"))
    if not found:
        return None
    newest = found[-1]
    s = json.loads(newest.read_text())
    report = newest.parent / "report.md"
    return {"mean_jct_err": s.get("mean_jct_err"), "max_jct_err": s.get("max_jct_err"),
            "held_out_mean_jct_err": s.get("held_out_mean_jct_err"), "runs": len(s.get("runs") or []),
            "report": str(report.relative_to(REPO) if report.is_relative_to(REPO) else report)}


def grid(quick: bool, progress=print) -> list[dict[str, Any]]:
    """Every row's cells (each MaxLen, each agent count), simulated."""
    out = []
    for row in PAPER_ROWS:
        for maxlen, agents in ((x, n) for x in MAXLENS for n in row.agents(quick)):
            c = simulate_cell(row, maxlen, agents)
            what = (f"speed-up {c['speedup']:.3g}x" if c["speedup"] is not None else
                    f"{c['failed']} of {c['requests']} requests failed: {c['failure']}")
            progress(f"  simulated {row.label} {row.cluster} {maxlen}, {c['agents']} agents: {what} "
                     f"({c['requests']} requests in {c['sim_wall_s']} s)")
            out.append(c)
    return out
