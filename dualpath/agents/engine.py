"""Engine process: one "GPU" (model + registered HBM) in its own namespace.

Its only interface is its CNIC, so every byte into or out of its HBM, H2D
from its own node's DRAM included, crosses that shaped NIC. A prefill engine
serves `prefill`; a decode engine serves `decode`.
"""
from __future__ import annotations

from dualpath.agents.common import base_args, exit_on_sigterm, make_agent, wiring_handlers
from dualpath.agents.leader import EngineLoad, GroupLeader, serve_state
from dualpath.control import RpcServer


def main() -> None:
    ap = base_args(__doc__)
    ap.add_argument("--role", required=True, choices=["prefill", "decode"])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--hbm-bytes", type=int, required=True)
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()
    exit_on_sigterm()

    import torch

    torch.set_num_threads(1)  # bit-exact with the reference, and no thread fights on 2 cores
    from dualpath.buffers import ByteAllocator
    from dualpath.engines.decode import decode as run_decode
    from dualpath.engines.prefill import prefill_batch as run_prefill_batch
    from dualpath.kv_connector import BasicConnector, LayerwiseConnector, LoadPlan, OracleConnector, PastRead
    from dualpath.kv_spans import Span
    from dualpath.layouts import BlockGeometry
    from dualpath.model import Transformer

    model = Transformer.from_pretrained(args.checkpoint)
    geom = BlockGeometry.from_config(model.config, block_size=args.block_size)
    agent, hbm = make_agent(args, "hbm", args.hbm_bytes, "hbm")
    alloc = ByteAllocator(args.hbm_bytes, f"{args.name} HBM")
    kv_per_token = geom.bytes_per_token_per_layer * geom.n_layer
    load = EngineLoad(args.hbm_bytes // kv_per_token)  # what this engine reports to its group leader
    leading: list[GroupLeader] = []

    profiled = None
    if args.role == "prefill":  # what the scheduler needs of this engine: beta and the quota's cost model
        from testbed.profile import profile_model

        profiled = profile_model(model, reps=1, small=True)

    def _connector(mode: str, plan: LoadPlan):
        if mode == "oracle":
            return OracleConnector(agent, hbm, alloc, geom)
        if plan.dst is None:
            raise ValueError(f"mode {mode!r} needs a destination span")
        if mode == "basic":
            return BasicConnector(agent, hbm, alloc, geom)
        if mode == "layerwise":
            return LayerwiseConnector(agent, hbm, alloc, geom)
        raise ValueError(f"unknown prefill mode {mode!r}")

    def _plan(r: dict) -> LoadPlan:
        reads = tuple(PastRead.from_msg(x) for x in r.get("reads") or ())
        crcs = r.get("past_crcs")
        n_hit = int(r["n_hit"])
        if r["mode"] == "oracle":  # nothing is read: the past is zeros already "in HBM"
            reads = (PastRead(Span("", "", 0), 0, n_hit),) if n_hit else ()
        return LoadPlan(r["request"], n_hit, len(r["tokens"]), reads,
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
            plan = _plan(r)
            items.append((list(r["tokens"]), plan, _connector(r["mode"], plan)))
        outs = run_prefill_batch(model, items)
        for r in requests:
            if r.get("last", True):
                load.finished(r["request"])
        results = []
        for (_, _, conn), out in zip(items, outs):
            s = conn.stats
            results.append({"first_token": out.first_token, "compute_s": out.compute_s,
                            "compute_cpu_s": out.compute_cpu_s, "total_s": out.total_s,
                            "read_bytes": s.read_bytes, "written_bytes": s.written_bytes,
                            "read_wait_s": s.read_wait_s, "peak_hit_bytes": s.peak_hit_bytes,
                            "layer_hashes": s.layer_hashes, "write_crcs": s.write_crcs,
                            "reread_bytes": s.reread_bytes})
        return {"results": results, "attention_s": sum(o.compute_cpu_s for o in outs),
                "attention_wall_s": sum(o.compute_s for o in outs)}

    def decode(request: str, n_prompt: int, first_token: int, gen_len: int, src: dict | None,
               wb: dict | None, first_new_block: int, expect_crcs: list[int] | None = None) -> dict:
        out = run_decode(request, model, agent, hbm, alloc, geom, n_prompt, first_token, gen_len,
                         Span.from_msg(src) if src else None, Span.from_msg(wb) if wb else None,
                         first_new_block, expect_crcs)
        load.finished(request)
        return {"tokens": out.tokens, "written_blocks": out.written_blocks, "layer_hashes": out.layer_hashes,
                "read_bytes": out.read_bytes, "written_bytes": out.written_bytes, "total_s": out.total_s,
                "block_crcs": out.block_crcs, "reread_bytes": out.reread_bytes}

    def lead(group: str, scheduler: str, members: dict[str, list[str]], nodes: dict[str, str],
             interval_s: float = 0.02) -> dict:
        """Become the leader of `group`: pull for it from `scheduler` until `unlead`.
        members: engine -> [node, role, state endpoint]; nodes: node -> host state endpoint."""
        if leading:
            raise ValueError(f"{args.name} already leads group {leading[0].group}")
        leading.append(GroupLeader(group, scheduler, {e: tuple(v) for e, v in members.items()}, nodes,
                                   kv_per_token, interval_s).start())
        return {}

    def unlead() -> dict:
        return leading.pop().stop() if leading else {}

    serve_state(args.ip, args.control_port, {
        "load": load.report,
        "assigned": lambda request, tokens: load.assigned(request, tokens) or {},
    })
    extra = {k: profiled[k] for k in ("prefill_tokens_per_s", "cost_model")} if profiled else {}
    handlers = {**wiring_handlers(agent, extra), "lead": lead, "unlead": unlead,
                **({"prefill_batch": prefill_batch} if args.role == "prefill"
                   else {"decode": decode})}
    server = RpcServer(f"tcp://{args.ip}:{args.control_port}", handlers)
    print(f"ready {args.name} {agent.transport_in_use}", flush=True)
    try:
        server.serve(idle=agent.progress)  # no progress thread here: keep peers' endpoints settled
    finally:
        agent.close()


if __name__ == "__main__":
    main()
