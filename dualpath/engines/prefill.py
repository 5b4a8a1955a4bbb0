"""Prefill engine (PE): layerwise prefill of a batch of requests through their KV connectors."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from dualpath.engines.clock import DeviceClock, PassTiming
from dualpath.engines.collective import CollectiveGroup
from dualpath.kv.connector import KVConnector, LoadPlan
from dualpath.model import Transformer
from dualpath.scheduler.cost_model import AttentionCostModel

# Waiting this long for a layer's KV means it was not in yet: the layer then starts when it came.
# Shorter, the KV was there (the wait was the connector's own bookkeeping): the layer starts when
# the previous one's window ends, even if the previous compute ran past it.
IO_WAIT_S = 0.001


@dataclass
class PrefillOutcome:
    first_token: int
    compute_s: float  # this request's layer compute (its attention and MLP) in the batch, wall time
    # the same as CPU time of the computing thread: what a GPU's kernel time stands for when
    # time is the CPU's (engines share two cores, and wall time includes the others' turns)
    compute_cpu_s: float


def prefill_batch(model: Transformer, items: list[tuple[list[int], LoadPlan, KVConnector]],
                  clock: DeviceClock | None = None, cost: AttentionCostModel | None = None,
                  collective: CollectiveGroup | None = None) -> tuple[list[PrefillOutcome], PassTiming]:
    """Run each request's miss tokens after its past tokens, one layer at a time for the batch.

    Per layer: wait until every request's past KV of that layer is in HBM (the connectors
    prefetch the next layer meanwhile), compute the layer for the whole batch, hold it for the
    target's layer time (1/n_layer of the pass the cost model predicts, on an emulated clock),
    then hand each request's new KV to its connector. The KV of layer l leaves when the target
    would have computed it, and layer l+1's load overlaps layer l's compute, as on a GPU.

    The windows follow the target's schedule: layer l starts when its KV is in and layer l-1's
    window has ended. A layer whose CPU compute runs past its window ships late, but the next
    window stays where it was, so the pass can catch up; the pass is late only by how far its
    last layer ends past the schedule (what the fidelity verdict judges).

    With a `collective` (the group's AllToAll), every layer ends with one over the CNIC for the
    batch's new tokens, after its KV is handed to the connectors (the KV ships while the
    collective runs, as on a GPU). The pass waits for it, and the schedule moves by exactly its
    real duration: on the target it starts when the layer's compute window ends, and its real
    time on the emulated links is already the target's times the dilation. So a slow collective
    lengthens the pass (the isolation experiment measures that) but is never lateness; compute
    that ran past its window stays late by the same amount as before.
    """
    clock = clock or DeviceClock()
    n_layer = model.config.n_layer
    layer_s = 0.0
    if clock.emulated:
        if cost is None:
            raise ValueError("an emulated clock needs the target's prefill cost model")
        layer_s = cost.predict((plan.n_past, len(tokens)) for tokens, plan, _ in items) / n_layer
    timing = PassTiming()
    n_new = sum(len(tokens) for tokens, _, _ in items)  # the tokens the layer's AllToAll routes
    xs = [model.embed(tokens) for tokens, _, _ in items]
    compute = [0.0] * len(items)
    compute_cpu = [0.0] * len(items)
    started = []
    try:
        for _, plan, conn in items:
            conn.start_load(plan)
            started.append(conn)
        end = clock.now()  # the emulated schedule: each layer starts when its KV is in and the
        for layer in range(n_layer):  # previous layer's window is over, and lasts layer_s
            w0 = clock.now()
            pasts = [conn.wait_for_layer(layer) for _, _, conn in items]
            t0 = clock.now()
            timing.io_wait_s += t0 - w0
            new_kv = []
            for i, (_, plan, _) in enumerate(items):
                c0, u0 = time.perf_counter(), time.thread_time()
                pk, pv = pasts[i] if pasts[i] is not None else (None, None)
                xs[i], k, v = model.layer_forward(layer, xs[i], plan.n_past, pk, pv)
                compute[i] += time.perf_counter() - c0
                compute_cpu[i] += time.thread_time() - u0
                new_kv.append((k, v))
            # a layer whose compute ran long starts the next one late, which may catch the
            # schedule up (the windows stay where the target would have them)
            start = max(end, t0) if t0 - w0 > IO_WAIT_S else end
            end = clock.hold(start, layer_s, timing)
            for (_, _, conn), (k, v) in zip(items, new_kv):
                conn.save_layer(layer, k, v)
            if collective is not None:
                rec = collective.run(n_new)
                end += rec.latency_s
                timing.collective_s += rec.latency_s
                timing.collectives += 1
        clock.finish(end, timing)
    finally:
        for conn in started:
            conn.wait_for_save()
    timing.compute_wall_s, timing.compute_cpu_s = sum(compute), sum(compute_cpu)
    out = []
    for i, (tokens, plan, _) in enumerate(items):
        logits = model.logits(xs[i][-1:], plan.n_past + len(tokens) - 1)
        out.append(PrefillOutcome(int(torch.argmax(logits[-1])), compute[i], compute_cpu[i]))
    return out, timing
