"""The modes of the ablation ladder and the scheduler's read-path policy in each: shared by the
testbed's runs (testbed.experiments.ablation, testbed.cluster.conductor) and the simulator (testbed.sim.drive), so both
configure the one scheduler alike. Kept free of heavy imports.

Every mode runs through the scheduler (Algorithm 1 for PEs, the two DE phases); the modes differ
in the read path it picks and in the connector (dualpath/kv/plan.py): basic reads on the PE side
and loads every layer before computing; layerwise overlaps each layer's load with the previous
one's compute; dualpath-rr reads on both sides in turn; dualpath on the side with the shorter read
queue; dualpath-split on both at once; oracle skips all I/O (dualpath's decisions, nothing moved).
"""
from __future__ import annotations

MODES = ("basic", "layerwise", "dualpath", "dualpath-rr", "dualpath-split", "oracle")
LADDER = ("basic", "layerwise", "dualpath-rr", "dualpath", "oracle")  # the demo's order

PATH_POLICY = {"basic": "pe", "layerwise": "pe", "dualpath-rr": "rr", "dualpath": "shorter",
               "dualpath-split": "split", "oracle": "shorter"}


def connector_of(mode: str) -> str:
    """The prefill connector a mode runs (dualpath.kv.plan.CONNECTORS)."""
    return "oracle" if mode == "oracle" else "basic" if mode == "basic" else "layerwise"
