"""The paper's Table 1 (cache-compute ratio, GB/PFLOP) recomputed from the public configs.

Method and paper values: shared/reference/dualpath-article-zh.txt section 1.1. The paper gives, per
model, a range over 16K-64K contexts; its numerator/denominator are not stated, but the article
reproduces them as: KV bytes of the context (V3.2 without the indexer key cache) over the forward
FLOPs of the 429 appended tokens. `paper` is the range endpoint at 16K and 64K, None elsewhere
(the paper's text also quotes "about 22" for V3.2 on the trace, mean context 32,721 tokens).
The ratio depends on the model only (GPU speed cancels), so any GPU gives the same table.
"""
from __future__ import annotations

from collections.abc import Iterable

from .cost import TRACE_APPEND_TOKENS, Target
from .models import MODELS
from .specs import GPUS

PAPER_RANGE: dict[str, tuple[float, float] | None] = {
    "deepseek-v3": (4.8, 5.8),
    "deepseek-v3.2": (13.0, 36.0),
    "qwen2.5-32b": (117.0, 267.0),
    "ds-27b": None,  # not in Table 1
}
PAPER_LOW_CONTEXT, PAPER_HIGH_CONTEXT = 16384, 65536


def paper_value(model_name: str, context: int) -> float | None:
    """Table 1's endpoint for this model at 16K (low) or 64K (high); None at any other context."""
    r = PAPER_RANGE.get(model_name)
    if r is None:
        return None
    return {PAPER_LOW_CONTEXT: r[0], PAPER_HIGH_CONTEXT: r[1]}.get(context)


def table1_rows(contexts: Iterable[int] = (16384, 32768, 65536),
                append: int = TRACE_APPEND_TOKENS) -> list[dict]:
    """One row per model x context: {model, context_tokens, append_tokens, gb_per_pflop, paper}."""
    rows = []
    for name in PAPER_RANGE:
        t = Target(GPUS["h800"], MODELS[name])
        for ctx in contexts:
            rows.append({"model": name, "context_tokens": ctx, "append_tokens": append,
                         "gb_per_pflop": t.cache_compute_ratio(ctx, append), "paper": paper_value(name, ctx)})
    return rows
