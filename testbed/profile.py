"""`dualpath profile`: fit the compute-quota cost model on the real engine code.

Times the prefill layer loop the engines run (same model file, one thread, as
in the engine processes) over a grid of (cached, new) token counts, fits the
scheduler's AttentionCostModel by non-negative least squares, and checks it on
samples it was not fitted on.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

from dualpath.model import Transformer
from dualpath.scheduler.batching import largest_fitting_chunk
from dualpath.scheduler.cost_model import AttentionCostModel, ProfileSample


def _time_prefill(model: Transformer, cached: int, new: int, reps: int) -> float:
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
    samples = [ProfileSample(((c, n),), _time_prefill(model, c, n, reps)) for c, n in grid]
    fit = AttentionCostModel.fit(samples)
    return {"cost_model": fit.to_dict(), "samples": [{"batch": list(s.batch), "seconds": s.seconds} for s in samples],
            "prefill_tokens_per_s": 512 / _time_prefill(model, 0, 512, reps)}


def profile(checkpoint: Path, quota_s: float = 0.3, reps: int = 3) -> dict[str, Any]:
    torch.set_num_threads(1)  # as the engines run
    model = Transformer.from_pretrained(checkpoint)
    grid = [(c, n) for c in (0, 256, 1024, 2048) for n in (16, 64, 256, 512)]
    held_out = [(512, 128), (1536, 32), (128, 384)]
    samples = [ProfileSample(((c, n),), _time_prefill(model, c, n, reps)) for c, n in grid]
    fit = AttentionCostModel.fit(samples)
    checks = []
    for c, n in held_out:
        t = _time_prefill(model, c, n, reps)
        checks.append({"cached": c, "new": n, "measured_s": t, "predicted_s": fit.predict([(c, n)]),
                       "rel_error": abs(fit.predict([(c, n)]) - t) / t})
    tokens_per_s = 512 / _time_prefill(model, 0, 512, reps)
    # What the quota does to a request that would overflow it on its own.
    big_cached, big_new = 2048, 8192
    chunk = largest_fitting_chunk(fit, big_cached, big_new, 0.0, quota_s)
    return {"checkpoint": str(checkpoint), "quota_s": quota_s, "cost_model": fit.to_dict(),
            "samples": [{"batch": list(s.batch), "seconds": s.seconds} for s in samples],
            "held_out": checks, "median_rel_error_held_out": statistics.median(x["rel_error"] for x in checks),
            "prefill_tokens_per_s": tokens_per_s, "beta_tokens_at_5s": 5 * tokens_per_s,
            "example_chunk": {"cached": big_cached, "new": big_new, "largest_chunk_in_quota": chunk}}
