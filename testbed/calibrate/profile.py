"""`dualpath profile model`: fit the compute-quota cost model on the real engine code.

Times the prefill layer loop the engines run (same model file, one thread, as
in the engine processes) over a grid of (cached, new) token counts, fits the
scheduler's AttentionCostModel by non-negative least squares, and checks it on
samples it was not fitted on.
"""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import torch

from dualpath.engines.profile import time_prefill
from dualpath.model import Transformer
from dualpath.scheduler.batching import largest_fitting_chunk
from dualpath.scheduler.cost_model import AttentionCostModel, ProfileSample
from testbed.paths import shown_path


def profile(checkpoint: Path, quota_s: float = 0.3, reps: int = 3) -> dict[str, Any]:
    torch.set_num_threads(1)  # as the engines run
    model = Transformer.from_pretrained(checkpoint)
    grid = [(c, n) for c in (0, 256, 1024, 2048) for n in (16, 64, 256, 512)]
    held_out = [(512, 128), (1536, 32), (128, 384)]
    samples = [ProfileSample(((c, n),), time_prefill(model, c, n, reps)) for c, n in grid]
    fit = AttentionCostModel.fit(samples)
    checks = []
    for c, n in held_out:
        t = time_prefill(model, c, n, reps)
        checks.append({"cached": c, "new": n, "measured_s": t, "predicted_s": fit.predict([(c, n)]),
                       "rel_error": abs(fit.predict([(c, n)]) - t) / t})
    tokens_per_s = 512 / time_prefill(model, 0, 512, reps)
    # What the quota does to a request that would overflow it on its own.
    big_cached, big_new = 2048, 8192
    chunk = largest_fitting_chunk(fit, big_cached, big_new, 0.0, quota_s)
    return {"checkpoint": shown_path(checkpoint), "quota_s": quota_s, "cost_model": fit.to_dict(),
            "samples": [{"batch": list(s.batch), "seconds": s.seconds} for s in samples],
            "held_out": checks, "median_rel_error_held_out": statistics.median(x["rel_error"] for x in checks),
            "prefill_tokens_per_s": tokens_per_s, "beta_tokens_at_5s": 5 * tokens_per_s,
            "example_chunk": {"cached": big_cached, "new": big_new, "largest_chunk_in_quota": chunk}}
