"""The engine's own cost model on the host's clock: fitted on the prefill loop it runs.

When time is the CPU's (`compute: cpu`), a prefill engine fits the compute-quota cost model on
its own layer loop at start (same model file, one thread) and measures its prefill throughput,
from which the scheduler derives beta. `dualpath profile model` (testbed/calibrate/profile.py) runs the same
fit with held-out checks.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from dualpath.model import Transformer
from dualpath.scheduler.cost_model import AttentionCostModel, ProfileSample


def time_prefill(model: Transformer, cached: int, new: int, reps: int) -> float:
    c = model.config
    past = [(torch.zeros(cached, c.n_kv_heads, c.head_dim), torch.zeros(cached, c.n_kv_heads, c.head_dim))
            for _ in range(c.n_layer)] if cached else None
    tokens = [4 + (i % 500) for i in range(new)]
    best = float("inf")
    for _ in range(reps):
        x = model.embed(tokens)
        # CPU time of this thread, as the engines measure their attention time: engines
        # profile at the same moment on shared cores, and wall time would count the others.
        t0 = time.thread_time()
        for layer in range(c.n_layer):
            pk, pv = past[layer] if past else (None, None)
            x, _, _ = model.layer_forward(layer, x, cached, pk, pv)
        best = min(best, time.thread_time() - t0)
    return best


def profile_model(model: Transformer, reps: int = 3, small: bool = False) -> dict[str, Any]:
    """Fit the cost model and measure prefill throughput on `model` (the engine calls this at start)."""
    grid = [(c, n) for c in ((0, 512, 2048) if small else (0, 256, 1024, 2048))
            for n in ((16, 128, 512) if small else (16, 64, 256, 512))]
    samples = [ProfileSample(((c, n),), time_prefill(model, c, n, reps)) for c, n in grid]
    fit = AttentionCostModel.fit(samples)
    return {"cost_model": fit.to_dict(), "samples": [{"batch": list(s.batch), "seconds": s.seconds} for s in samples],
            "prefill_tokens_per_s": 512 / time_prefill(model, 0, 512, reps)}
