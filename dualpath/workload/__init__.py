"""Workloads (DESIGN.md section 9): generated agentic trajectories, the paper's trace statistics,
public Mooncake traces, scripted real-text conversations (text.py), and the KV hit rate they imply."""
from .trajectories import (
    RESERVED_TOKENS, PaperTraceSet, Trajectory, Turn, TurnHit, Workload, WorkloadConfig, demo_workload,
    generate, generate_lengths, hit_rate, paper_presets, poisson_arrivals, scaled, turn_hits, with_arrivals, workload_stats,
)
from .text import TextTrajectory, TextTurn, TextWorkload, text_workload

__all__ = [
    "MOONCAKE_BLOCK", "TraceError", "TraceRequest", "load_mooncake", "prefix_hit_rate", "to_trajectories",
    "RESERVED_TOKENS", "PaperTraceSet", "Trajectory", "Turn", "TurnHit", "Workload", "WorkloadConfig",
    "demo_workload", "generate", "generate_lengths", "hit_rate", "paper_presets", "poisson_arrivals", "scaled", "turn_hits",
    "with_arrivals", "workload_stats", "TextTrajectory", "TextTurn", "TextWorkload", "text_workload",
]

_MOONCAKE = ("MOONCAKE_BLOCK", "TraceError", "TraceRequest", "load_mooncake", "prefix_hit_rate", "to_trajectories")


def __getattr__(name: str):
    # The trace loader is imported on first use: `python -m dualpath.workload.mooncake` would
    # otherwise find it imported by this package before running it (runpy's warning).
    if name in _MOONCAKE:
        from . import mooncake

        return getattr(mooncake, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
