"""Prefill engine (PE): layerwise prefill of one request through a KV connector."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from dualpath.kv_connector import KVConnector, LoadPlan
from dualpath.model import Transformer


@dataclass
class PrefillOutcome:
    first_token: int
    compute_s: float
    total_s: float


def prefill(model: Transformer, tokens_new: list[int], plan: LoadPlan, conn: KVConnector) -> PrefillOutcome:
    """Run the miss tokens after n_hit stored tokens, one layer at a time.

    Per layer: wait for its hit KV (the connector prefetches the next layer
    meanwhile), compute, hand the layer's new KV to the connector, move on.
    """
    t0 = time.perf_counter()
    compute = 0.0
    x = model.embed(tokens_new)
    conn.start_load(plan)
    try:
        for layer in range(model.config.n_layer):
            past = conn.wait_for_layer(layer)
            c0 = time.perf_counter()
            pk, pv = past if past is not None else (None, None)
            x, k, v = model.layer_forward(layer, x, plan.n_hit, pk, pv)
            compute += time.perf_counter() - c0
            conn.save_layer(layer, k, v)
    finally:
        conn.wait_for_save()
    logits = model.logits(x[-1:], plan.n_hit + len(tokens_new) - 1)
    return PrefillOutcome(int(torch.argmax(logits[-1])), compute, time.perf_counter() - t0)
