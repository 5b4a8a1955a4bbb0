"""The DualPath scheduler (DESIGN.md section 8): pure decision logic plus its control-plane service.

Policies are plain functions over the scheduler's engine state; `Scheduler` wires them to events
and an injected clock; `service` puts it behind a ZeroMQ ROUTER that group leaders pull from.
"""
from .batching import DEFAULT_QUOTA_S, PackedBatch, PrefillItem, PrefillQueue, largest_fitting_chunk, pack_batch
from .core import Scheduler
from .cost_model import AttentionCostModel, ProfileSample
from .records import Assignment, EngineReport, ReadPath, Request, Role
from .thresholds import Profile, Thresholds

__all__ = [
    "DEFAULT_QUOTA_S", "PackedBatch", "PrefillItem", "PrefillQueue", "largest_fitting_chunk", "pack_batch",
    "Scheduler", "AttentionCostModel", "ProfileSample", "Assignment", "EngineReport", "ReadPath",
    "Request", "Role", "Profile", "Thresholds",
]
