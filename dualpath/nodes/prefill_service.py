"""A prefill engine's commands: one forward pass of a batch per `prefill_batch`."""
from __future__ import annotations

from typing import Callable

import numpy as np

from dualpath.nodes.leader import EngineLoad
from dualpath.kv.buffers import ByteAllocator
from dualpath.engines.clock import DeviceClock
from dualpath.engines.collective import CollectiveGroup
from dualpath.engines.prefill import prefill_batch as run_prefill_batch
from dualpath.kv.connector import BasicConnector, LayerwiseConnector, LoadPlan, OracleConnector, PastRead
from dualpath.kv.plugin import CheckedPrefill, ConnectorPlugin, connector_name
from dualpath.kv.spans import Span
from dualpath.kv.layouts import BlockGeometry
from dualpath.model import Transformer
from dualpath.scheduler.cost_model import AttentionCostModel


def prefill_handlers(model: Transformer, agent, hbm: np.ndarray, alloc: ByteAllocator, geom: BlockGeometry,
                     load: EngineLoad, clock: DeviceClock, cost: AttentionCostModel | None,
                     collective: CollectiveGroup | None = None, plugin: type[ConnectorPlugin] | None = None
                     ) -> tuple[dict[str, Callable[..., dict]], dict]:
    """The engine's `prefill_batch` command, and what its `hello` adds: on the CPU's own clock,
    the cost model fitted on this engine's prefill loop and its throughput (for beta). With a
    `collective`, every layer of every pass runs the group's AllToAll, and the reply's timing
    lists each one (`collective_log`). A `plugin` with a prefill class runs it where the layerwise
    connector would run, checked by the engine (dualpath/kv/plugin.py)."""
    hello: dict = {}
    if not clock.emulated:
        from dualpath.engines.profile import profile_model

        hello = profile_model(model, reps=1, small=True)
        hello = {k: hello[k] for k in ("prefill_tokens_per_s", "cost_model")}

    def connector(mode: str, plan: LoadPlan):
        if mode == "oracle":
            return OracleConnector(agent, hbm, alloc, geom, device=model.device)
        if plan.dst is None:
            raise ValueError(f"mode {mode!r} needs a destination span")
        if mode == "basic":
            return BasicConnector(agent, hbm, alloc, geom, device=model.device)
        if mode == "layerwise" and plugin is not None and plugin.prefill is not None:
            return CheckedPrefill(plugin.prefill(agent, hbm, alloc, geom, device=model.device), geom)
        if mode == "layerwise":
            return LayerwiseConnector(agent, hbm, alloc, geom, device=model.device)
        raise ValueError(f"unknown prefill mode {mode!r}")

    def plan_of(r: dict) -> LoadPlan:
        reads = tuple(PastRead.from_msg(x) for x in r.get("reads") or ())
        crcs = r.get("past_crcs")
        n_past = int(r["n_past"])
        if r["mode"] == "oracle":  # nothing is read: the past is zeros already "in HBM"
            reads = (PastRead(Span("", "", 0), 0, n_past),) if n_past else ()
        return LoadPlan(r["request"], n_past, len(r["tokens"]), reads,
                        Span.from_msg(r["dst"]) if r.get("dst") else None,
                        int(r.get("forward_past", 0)), tuple(crcs) if crcs is not None else None,
                        str(r.get("tag", "")))

    def prefill_batch(requests: list[dict]) -> dict:
        """One forward pass: every request's layer l, then every request's layer l+1, ...
        A request may be one chunk of a longer prompt (its past then includes earlier chunks)."""
        items = []
        for r in requests:
            if not r.get("tokens"):
                raise ValueError(f"request {r.get('request')!r}: a prefill needs at least one miss token")
            plan = plan_of(r)
            items.append((list(r["tokens"]), plan, connector(r["mode"], plan)))
        outs, timing = run_prefill_batch(model, items, clock, cost, collective)
        t_end = clock.now()  # the first tokens exist now
        for r in requests:
            if r.get("last", True):
                load.finished(r["request"])
        results = []
        for (_, _, conn), out in zip(items, outs):
            s = conn.stats
            results.append({"first_token": out.first_token, "compute_s": out.compute_s,
                            "compute_cpu_s": out.compute_cpu_s,
                            "read_bytes": s.read_bytes, "written_bytes": s.written_bytes,
                            "read_wait_s": s.read_wait_s, "peak_hit_bytes": s.peak_hit_bytes,
                            "layer_hashes": s.layer_hashes, "write_crcs": s.write_crcs,
                            "reread_bytes": s.reread_bytes, "connector": connector_name(conn)})
        tm = {**timing.to_dict(), "overran": timing.overran}
        if collective is not None:
            tm["collective_log"] = collective.take_log()
        return {"results": results, "t_end": t_end, "timing": tm,
                "attention_s": sum(o.compute_cpu_s for o in outs),
                "attention_wall_s": sum(o.compute_s for o in outs)}

    return {"prefill_batch": prefill_batch}, hello
