"""Simulated projections beside a figure's testbed numbers, never in its headline.

Some sizes need more testbed time than this host has (fig7's full turn counts, fig9's paper
model): the figure then also shows what `simulator`, calibrated on testbed runs
(simulator/calibration.json, `dualpath sim --calibrate`), gives for the same configuration. The
report says it is simulated and, where a testbed run of a nearby configuration exists, shows the
simulator's value for that run beside the testbed's so the reader can judge the projection.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from simulator.calibration import COMMITTED
from testbed.reproduce.plan import RunConfig

CALIBRATION = COMMITTED


def calibration(path: Path = CALIBRATION):
    """The committed calibration, or None where there is none (a projection is then left out). A
    projection is one simulation: every latency exactly its value (no jitter), so one order of
    events, the same on every machine."""
    from simulator.calibration import Calibration

    return Calibration.load(path).exact() if path.exists() else None


def simulate_config(cfg: RunConfig, cal) -> dict[str, Any]:
    """`cfg`'s modes in the simulator: emulated JCT per mode, the dilation, and the testbed
    seconds the same runs would have held this host."""
    from testbed.sim.drive import Geometry, sim_config, simulate, trajectories

    sc = sim_config(cfg.topology_obj(), Geometry(), cal=cal, quota_s=cfg.quota_ms / 1000)
    res = simulate(sc, trajectories(cfg.workload.config(), sc.dilation), cfg.modes)
    return {"jct_s": {m: r.jct_s / sc.dilation for m, r in res.items()}, "dilation": sc.dilation,
            "testbed_s": sum(r.jct_s for r in res.values())}
