"""Engine process: one "GPU" (model + registered HBM) in its own namespace.

`--device cuda` puts the model and the KV it computes with in real GPU memory; the registered
region is then its page-locked host staging (dualpath/model/device.py).

Its only interface is its CNIC, so every byte into or out of its HBM, H2D
from its own node's DRAM included, crosses that shaped NIC. A prefill engine
serves `prefill_batch`; a decode engine takes `decode` requests on its decode
socket and batches every ready one (dualpath/engines/decode.py).

Time: with `--timing` naming an emulated clock (a dilation and the target's cost models),
every pass and decode step lasts what the target GPU takes, times the dilation
(dualpath/engines/clock.py). Without it, passes take what the CPU takes and a prefill
engine fits its cost model on its own prefill loop at start.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from dualpath.nodes.common import (
    base_args, exit_on_sigterm, freeze_startup_heap, jobs_port, make_agent, positive_int, run_auth, wiring_handlers,
)
from dualpath.nodes.leader import EngineLoad, GroupLeader, serve_state
from dualpath.control import RpcServer

ENGINE_NICE = -10  # CFS weight ~10x a default process while both want the CPU


def _parse_args() -> "argparse.Namespace":
    ap = base_args(__doc__)
    ap.add_argument("--role", required=True, choices=["prefill", "decode"])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--hbm-bytes", type=positive_int, required=True)
    ap.add_argument("--block-size", type=positive_int, default=16)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda: the model, its past KV and the decode "
                    "batch in GPU memory, fed from page-locked host memory (dualpath/model/device.py)")
    ap.add_argument("--timing", default="", help="JSON {dilation, prefill, decode}: the emulated clock "
                    "and the target's cost models; empty: the CPU's own time")
    ap.add_argument("--collectives", default="", help="JSON {port, peers, dispatch_per_token, "
                    "combine_per_token}: run the group's AllToAll on every layer; empty: none")
    ap.add_argument("--connector", default="", help="MODULE:CLASS of a ConnectorPlugin (dualpath/kv/plugin.py); "
                    "empty: the built-in connectors")
    ap.add_argument("--connector-path", default="", help="a folder to import the connector's module from")
    return ap.parse_args()


def main() -> None:
    args = _parse_args()
    exit_on_sigterm()
    auth = run_auth()
    if args.timing:
        _prioritize()

    import torch

    torch.set_num_threads(1)  # bit-exact with the reference, and no thread fights on 2 cores
    from dualpath.kv.buffers import ByteAllocator
    from dualpath.engines.clock import DeviceClock
    from dualpath.kv.layouts import BlockGeometry
    from dualpath.model import DecodeCache, Transformer
    from dualpath.model.device import DeviceError, host_buffer, resolve_device
    from dualpath.scheduler.cost_model import AttentionCostModel, DecodeCostModel
    from dualpath.scheduler.hbm import DecodeHbm

    try:
        device = resolve_device(args.device)
    except DeviceError as e:
        sys.exit(f"{args.name}: --device: {e}")
    plugin = _load_plugin(args)  # before the model loads: a plug-in that cannot load fails the start at once
    model = Transformer.from_pretrained(args.checkpoint, device=device)
    # One throwaway pass and step before serving: the first call of each kernel shape allocates
    # and builds tables, and on an emulated clock that one-time cost would overrun a real pass.
    model.decode_step([0], [DecodeCache(model, model.prefill([0] * 64).new_kv)])
    geom = BlockGeometry.from_config(model.config, block_size=args.block_size)
    agent, hbm = make_agent(args, "hbm", args.hbm_bytes, "hbm", host_buffer(args.hbm_bytes, device))
    alloc = ByteAllocator(args.hbm_bytes, f"{args.name} HBM")
    kv_per_token = geom.kv_bytes_per_token
    timing = json.loads(args.timing) if args.timing else None
    # the target's HBM for KV (emulated runs): admission counts it, not only this buffer's bytes
    hbm_budget = DecodeHbm(**timing["hbm"]) if timing and timing.get("hbm") else None
    tokens = args.hbm_bytes // kv_per_token
    load = EngineLoad(min(tokens, hbm_budget.tokens) if hbm_budget else tokens)  # what the leader is told
    clock = DeviceClock(timing["dilation"] if timing else None)
    collective, responder = None, None
    if args.collectives:
        from dualpath.engines.collective import CollectiveConfig, CollectiveGroup

        ccfg = CollectiveConfig.from_dict(json.loads(args.collectives))
        responder = _start_responder(args.ip, ccfg)
        collective = CollectiveGroup(ccfg)

    serve_state(args.ip, args.control_port, {
        "load": load.report,
        "assigned": lambda request, tokens: load.assigned(request, tokens) or {},
    }, auth=auth)
    common = {**_leader_handlers(args.name, kv_per_token, auth.secret),
              "load_pending": lambda: {"pending": load.pending()},
              # a request given to this engine that will not run here (it failed elsewhere, or was abandoned)
              "load_done": lambda request: load.finished(request) or {}}
    if args.role == "prefill":
        from dualpath.nodes.prefill_service import prefill_handlers

        cost = AttentionCostModel.from_dict(timing["prefill"]) if timing else None
        handlers, hello = prefill_handlers(model, agent, hbm, alloc, geom, load, clock, cost, collective, plugin)
        server = RpcServer(f"tcp://{args.ip}:{args.control_port}",
                           {**wiring_handlers(agent, hello), **common, **handlers}, auth=auth)
        # no progress thread here: progress when idle, so peers' endpoints settle
        _serve(args.name, agent, lambda: server.serve(idle=agent.progress), responder)
    else:
        from dualpath.nodes.decode_service import DecodeService

        cost = DecodeCostModel.from_dict(timing["decode"]) if timing else None
        service = DecodeService(model, agent, hbm, alloc, geom, load, clock, cost,
                                control=f"tcp://{args.ip}:{args.control_port}",
                                decode=f"tcp://{args.ip}:{jobs_port(args.control_port)}",
                                handlers={**wiring_handlers(agent), **common}, collective=collective, auth=auth,
                                plugin=plugin, hbm_budget=hbm_budget)
        _serve(args.name, agent, service.serve, responder)


def _leader_handlers(name: str, kv_per_token: int, secret: bytes) -> dict:
    """The control calls that make this engine its group's leader (`lead`) and stop it (`unlead`)."""
    leading: list[GroupLeader] = []

    def lead(group: str, scheduler: str, members: dict[str, list[str]], nodes: dict[str, str],
             interval_s: float = 0.02, bell: str | None = None) -> dict:
        """Become the leader of `group`: pull for it from `scheduler` until `unlead`.
        members: engine -> [node, role, state endpoint]; nodes: node -> host state endpoint;
        bell: the scheduler's doorbell (pull when it rings) or None (pull every interval_s)."""
        if leading:
            raise ValueError(f"{name} already leads group {leading[0].group}")
        leading.append(GroupLeader(group, scheduler, {e: tuple(v) for e, v in members.items()}, nodes,
                                   kv_per_token, interval_s, bell=bell, secret=secret).start())
        return {}

    def unlead() -> dict:
        return leading.pop().stop() if leading else {}

    return {"lead": lead, "unlead": unlead}


def _prioritize() -> None:
    """The engine stands for a GPU: its compute must not queue behind the emulation of NICs,
    storage and control that shares these two cores (a pass that waits for the CPU overruns its
    emulated window). It holds most of the time, so a higher priority costs the others little.
    Needs root, which the testbed has; without it the run only risks overruns."""
    try:
        os.nice(ENGINE_NICE)
    except OSError:
        pass


def _load_plugin(args: "argparse.Namespace"):
    """The run's ConnectorPlugin (dualpath/kv/plugin.py), or None; exits in one line if it cannot load."""
    if not args.connector:
        return None
    from dualpath.kv.plugin import ConnectorError, load_plugin

    try:
        return load_plugin(*args.connector.split(":"), args.connector_path or None)
    except ConnectorError as e:
        sys.exit(f"{args.name}: {e}")


def _serve(name: str, agent, serve, responder: subprocess.Popen | None) -> None:
    """Say ready, serve until shut down, then close the agent and the collective responder."""
    freeze_startup_heap()
    print(f"ready {name} {agent.transport_in_use}", flush=True)
    try:
        serve()
    finally:
        agent.close()
        if responder is not None:
            responder.terminate()


def _start_responder(ip: str, cfg) -> subprocess.Popen:
    """The engine's collective responder (dualpath/nodes/collective_peer.py), listening on its
    CNIC before the engine says ready, so a peer's first dispatch finds it."""
    proc = subprocess.Popen([sys.executable, "-m", "dualpath.nodes.collective_peer", "--ip", ip,
                             "--port", str(cfg.port), "--tos", str(cfg.tos)],
                            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    line = proc.stdout.readline().decode(errors="replace")  # bounded: it prints or exits
    if not line.startswith("listening"):
        proc.kill()
        raise RuntimeError(f"collective responder on {ip}:{cfg.port} did not start (exit {proc.wait()})")
    return proc


if __name__ == "__main__":
    main()
