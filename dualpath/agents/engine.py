"""Engine process: one "GPU" (model + registered HBM) in its own namespace.

Its only interface is its CNIC, so every byte into or out of its HBM, H2D
from its own node's DRAM included, crosses that shaped NIC. A prefill engine
serves `prefill`; a decode engine serves `decode`.
"""
from __future__ import annotations

from dualpath.agents.common import base_args, exit_on_sigterm, make_agent
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
    from dualpath.engines.prefill import prefill as run_prefill
    from dualpath.kv_connector import BasicConnector, LayerwiseConnector, LoadPlan, OracleConnector
    from dualpath.kv_spans import Span
    from dualpath.layouts import BlockGeometry
    from dualpath.model import Transformer

    model = Transformer.from_pretrained(args.checkpoint)
    geom = BlockGeometry.from_config(model.config, block_size=args.block_size)
    agent, hbm = make_agent(args, "hbm", args.hbm_bytes, "hbm")
    alloc = ByteAllocator(args.hbm_bytes, f"{args.name} HBM")

    def _profile_prefill(n: int = 512) -> float:
        """Prefill tokens per second of this engine (beta = 5 s of it): a timed warm run."""
        import time

        model.prefill(list(range(4, 4 + 64)))  # warm-up
        t0 = time.perf_counter()
        model.prefill([4 + (i % 500) for i in range(n)], last_only=True)
        return n / (time.perf_counter() - t0)

    tokens_per_s = _profile_prefill() if args.role == "prefill" else None

    def hello() -> dict:
        out = {"metadata": agent.metadata(), "transport": agent.transport_in_use}
        if tokens_per_s:
            out["prefill_tokens_per_s"] = tokens_per_s
        return out

    def add_peers(metadata: list[bytes]) -> dict:
        return {"peers": [agent.add_peer(md) for md in metadata]}

    def connect(peers: list[str]) -> dict:
        for p in peers:
            agent.connect(p)
        return {}

    def prefill(request: str, tokens: list[int], n_hit: int, mode: str, write: str,
                src: dict | None, dst: dict | None) -> dict:
        plan = LoadPlan(request, n_hit, len(tokens), Span.from_msg(src) if src else None,
                        Span.from_msg(dst) if dst else None)
        if not tokens:
            raise ValueError("a prefill needs at least one miss token")
        if mode == "oracle":
            conn = OracleConnector(agent, hbm, alloc, geom)
        elif (n_hit and plan.src is None) or plan.dst is None:
            raise ValueError(f"mode {mode!r} needs a destination span and, with hits, a source span")
        elif mode == "basic":
            conn = BasicConnector(agent, hbm, alloc, geom)
        elif mode == "layerwise":
            conn = LayerwiseConnector(agent, hbm, alloc, geom, write_hit=(write == "all"))
        else:
            raise ValueError(f"unknown prefill mode {mode!r}")
        out = run_prefill(model, tokens, plan, conn)
        s = conn.stats
        return {"first_token": out.first_token, "compute_s": out.compute_s, "total_s": out.total_s,
                "read_bytes": s.read_bytes, "written_bytes": s.written_bytes, "read_wait_s": s.read_wait_s,
                "peak_hit_bytes": s.peak_hit_bytes, "layer_hashes": s.layer_hashes, "write_crcs": s.write_crcs}

    def decode(request: str, n_prompt: int, first_token: int, gen_len: int, src: dict | None,
               wb: dict | None, first_new_block: int, expect_crcs: list[int] | None = None,
               crc_from: int = 0) -> dict:
        out = run_decode(request, model, agent, hbm, alloc, geom, n_prompt, first_token, gen_len,
                         Span.from_msg(src) if src else None, Span.from_msg(wb) if wb else None,
                         first_new_block, expect_crcs, crc_from)
        return {"tokens": out.tokens, "written_blocks": out.written_blocks, "layer_hashes": out.layer_hashes,
                "read_bytes": out.read_bytes, "written_bytes": out.written_bytes, "total_s": out.total_s,
                "block_crcs": out.block_crcs, "reread_bytes": out.reread_bytes}

    def shutdown() -> dict:
        return {"shutdown": True}

    handlers = {"hello": hello, "add_peers": add_peers, "connect": connect, "shutdown": shutdown,
                **({"prefill": prefill} if args.role == "prefill" else {"decode": decode})}
    server = RpcServer(f"tcp://{args.ip}:{args.control_port}", handlers)
    print(f"ready {args.name} {agent.transport_in_use}", flush=True)
    try:
        server.serve()
    finally:
        agent.close()


if __name__ == "__main__":
    main()
