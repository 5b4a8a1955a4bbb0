"""Prefill engine (PE): layerwise prefill of a batch of requests through their KV connectors."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from dualpath.kv_connector import KVConnector, LoadPlan
from dualpath.model import Transformer


@dataclass
class PrefillOutcome:
    first_token: int
    compute_s: float  # this request's layer compute (its attention and MLP) in the batch, wall time
    # the same as CPU time of the computing thread: what a GPU's kernel time stands for here,
    # where engines share two cores and wall time includes the time another engine ran
    compute_cpu_s: float
    total_s: float


def prefill(model: Transformer, tokens_new: list[int], plan: LoadPlan, conn: KVConnector) -> PrefillOutcome:
    """One request on its own: a batch of one."""
    return prefill_batch(model, [(tokens_new, plan, conn)])[0]


def prefill_batch(model: Transformer, items: list[tuple[list[int], LoadPlan, KVConnector]]
                  ) -> list[PrefillOutcome]:
    """Run each request's miss tokens after its stored tokens, one layer at a time for the batch.

    Per layer and request: wait for its hit KV (the connector prefetches the next
    layer meanwhile), compute, hand the layer's new KV to the connector. The batch's
    forward time is the sum of its requests' compute: what the compute quota caps.
    """
    t0 = time.perf_counter()
    xs = [model.embed(tokens) for tokens, _, _ in items]
    compute = [0.0] * len(items)
    compute_cpu = [0.0] * len(items)
    started = []
    try:
        for _, plan, conn in items:
            conn.start_load(plan)
            started.append(conn)
        for layer in range(model.config.n_layer):
            for i, (_, plan, conn) in enumerate(items):
                past = conn.wait_for_layer(layer)
                c0, u0 = time.perf_counter(), time.thread_time()
                pk, pv = past if past is not None else (None, None)
                xs[i], k, v = model.layer_forward(layer, xs[i], plan.n_hit, pk, pv)
                compute[i] += time.perf_counter() - c0
                compute_cpu[i] += time.thread_time() - u0
                conn.save_layer(layer, k, v)
    finally:
        for conn in started:
            conn.wait_for_save()
    out = []
    for i, (tokens, plan, _) in enumerate(items):
        logits = model.logits(xs[i][-1:], plan.n_hit + len(tokens) - 1)
        out.append(PrefillOutcome(int(torch.argmax(logits[-1])), compute[i], compute_cpu[i], time.perf_counter() - t0))
    return out
