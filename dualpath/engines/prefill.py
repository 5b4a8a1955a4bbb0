"""Prefill engine (PE): layerwise prefill of a batch of requests through their KV connectors."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from dualpath.engines.clock import DeviceClock, PassTiming
from dualpath.kv.connector import KVConnector, LoadPlan
from dualpath.model import Transformer
from dualpath.scheduler.cost_model import AttentionCostModel


@dataclass
class PrefillOutcome:
    first_token: int
    compute_s: float  # this request's layer compute (its attention and MLP) in the batch, wall time
    # the same as CPU time of the computing thread: what a GPU's kernel time stands for when
    # time is the CPU's (engines share two cores, and wall time includes the others' turns)
    compute_cpu_s: float


def prefill_batch(model: Transformer, items: list[tuple[list[int], LoadPlan, KVConnector]],
                  clock: DeviceClock | None = None, cost: AttentionCostModel | None = None
                  ) -> tuple[list[PrefillOutcome], PassTiming]:
    """Run each request's miss tokens after its past tokens, one layer at a time for the batch.

    Per layer: wait until every request's past KV of that layer is in HBM (the connectors
    prefetch the next layer meanwhile), compute the layer for the whole batch, hold it for the
    target's layer time (1/n_layer of the pass the cost model predicts, on an emulated clock),
    then hand each request's new KV to its connector. The KV of layer l leaves when the target
    would have computed it, and layer l+1's load overlaps layer l's compute, as on a GPU.
    """
    clock = clock or DeviceClock()
    n_layer = model.config.n_layer
    layer_s = 0.0
    if clock.emulated:
        if cost is None:
            raise ValueError("an emulated clock needs the target's prefill cost model")
        layer_s = cost.predict((plan.n_hit, len(tokens)) for tokens, plan, _ in items) / n_layer
    timing = PassTiming()
    xs = [model.embed(tokens) for tokens, _, _ in items]
    compute = [0.0] * len(items)
    compute_cpu = [0.0] * len(items)
    started = []
    try:
        for _, plan, conn in items:
            conn.start_load(plan)
            started.append(conn)
        for layer in range(n_layer):
            w0 = clock.now()
            pasts = [conn.wait_for_layer(layer) for _, _, conn in items]
            t0 = clock.now()
            timing.io_wait_s += t0 - w0
            new_kv = []
            for i, (_, plan, _) in enumerate(items):
                c0, u0 = time.perf_counter(), time.thread_time()
                pk, pv = pasts[i] if pasts[i] is not None else (None, None)
                xs[i], k, v = model.layer_forward(layer, xs[i], plan.n_hit, pk, pv)
                compute[i] += time.perf_counter() - c0
                compute_cpu[i] += time.thread_time() - u0
                new_kv.append((k, v))
            clock.hold(t0, layer_s, timing)
            for (_, _, conn), (k, v) in zip(items, new_kv):
                conn.save_layer(layer, k, v)
    finally:
        for conn in started:
            conn.wait_for_save()
    timing.compute_wall_s, timing.compute_cpu_s = sum(compute), sum(compute_cpu)
    out = []
    for i, (tokens, plan, _) in enumerate(items):
        logits = model.logits(xs[i][-1:], plan.n_hit + len(tokens) - 1)
        out.append(PrefillOutcome(int(torch.argmax(logits[-1])), compute[i], compute_cpu[i]))
    return out, timing
