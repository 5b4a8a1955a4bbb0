"""What every node process shares: argument parsing, the transport agent, the RPC loop."""
from __future__ import annotations

import argparse
import gc
import os
import signal
import sys

import numpy as np


# Beside a process's control socket: its state socket (what group leaders read) and, on a
# host agent, its read queue. Control traffic stays outside the kv port range (model class).
STATE_PORT_OFFSET = 1
LOAD_PORT_OFFSET = 2
JOBS_PORT_OFFSET = 3  # long commands, many outstanding: a host agent's flushes and waits, a DE's decodes
COLLECTIVE_PORT_OFFSET = 4  # an engine's collective responder (model class, like control)


def freeze_startup_heap() -> None:
    """Put what start-up allocated (torch, the model, the transport) beyond the garbage collector.

    A full collection walks every tracked object and holds the GIL while it does: with torch and
    a model loaded (~170k objects) it takes tens of ms, and the pass it lands in ends that late.
    Measured on this machine kind: 80-100 ms per full collection before, 0 ms after freezing.
    Those objects live as long as the process anyway, so nothing is leaked by never scanning them."""
    gc.collect()
    gc.freeze()


def state_port(control_port: int) -> int:
    return control_port + STATE_PORT_OFFSET


def load_port(control_port: int) -> int:
    return control_port + LOAD_PORT_OFFSET


def jobs_port(control_port: int) -> int:
    return control_port + JOBS_PORT_OFFSET


def collective_port(control_port: int) -> int:
    return control_port + COLLECTIVE_PORT_OFFSET


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (argparse turns the ValueError into a one-line usage error)."""
    n = int(text)
    if n < 1:
        raise ValueError(text)
    return n


def run_auth():
    """The process's run secret from its stdin (dualpath.control.read_secret), as an Auth for
    every socket it serves; exits with a one-line error without one."""
    from dualpath.control import Auth, read_secret

    try:
        return Auth(read_secret(sys.stdin.buffer))
    except ValueError as e:
        sys.exit(f"{os.path.basename(sys.argv[0])}: {e}")


def base_args(description: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--name", required=True, help="agent name (also the namespace name)")
    ap.add_argument("--iface", required=True, help="the only interface its KV bytes may use")
    ap.add_argument("--ip", required=True, help="address to serve control on")
    ap.add_argument("--control-port", type=int, default=5555)
    ap.add_argument("--transport", default="tcp", choices=["tcp", "rdma", "mooncake", "mooncake-rdma"],
                    help="NIXL over UCX's tcp or rdma, or Mooncake's transfer engine (its TCP or RDMA)")
    ap.add_argument("--port-range", default=None, help="kv listening sub-range, e.g. 22000-22099")
    return ap


def make_agent(args, region: str, nbytes: int, kind: str, buf: np.ndarray | None = None):
    """A kv-class transport agent (NIXL, or Mooncake's) on `args.iface` with one registered
    region of `nbytes` (`buf`, or zeros)."""
    from dualpath.transport import Agent
    from dualpath.transport.env import parse_port_range

    rng = parse_port_range(args.port_range) if args.port_range else None
    if args.transport.startswith("mooncake"):
        from dualpath.transport.env import require_rdma
        from dualpath.transport.mooncake import MooncakeAgent

        dev = require_rdma(None, args.iface) if args.transport == "mooncake-rdma" else None
        agent = MooncakeAgent(args.name, args.iface, "kv", port_range=rng, rdma_device=dev)
    else:
        # A host agent is a passive target: NIXL's progress thread serves its peers. An engine
        # polls its own transfers; a second thread there would only contend for UCX's lock.
        agent = Agent(args.name, args.iface, "kv", args.transport, port_range=rng,
                      progress_thread=(kind == "dram"))
    if buf is None:
        buf = np.zeros(nbytes, dtype=np.uint8)  # calloc: pages appear as they are touched
    agent.register(region, buf, kind=kind)
    return agent, buf


def exit_on_sigterm() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def wiring_handlers(agent, extra_hello: dict | None = None) -> dict:
    """The control commands every node process serves: introduce its transport agent to
    peers, open connections ahead of the first transfer, and shut down."""
    hello_reply = {"metadata": agent.metadata(), "transport": agent.transport_in_use, **(extra_hello or {})}

    def hello() -> dict:
        return hello_reply

    def add_peers(metadata: list[bytes]) -> dict:
        return {"peers": [agent.add_peer(m) for m in metadata]}

    def connect(peers: list[str]) -> dict:
        for p in peers:
            agent.connect(p)
        return {}

    def shutdown() -> dict:
        return {"shutdown": True}

    return {"hello": hello, "add_peers": add_peers, "connect": connect, "shutdown": shutdown}
