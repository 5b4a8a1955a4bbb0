#!/usr/bin/env python3
"""One side of a user's KV transfer between two engine namespaces, with NIXL over UCX.

    python kv_peer.py target    --bytes N   # passive: registers a buffer, checks what lands in it
    python kv_peer.py initiator --bytes N   # WRITEs a buffer into the target's, READs it back

Run each in an engine's namespace (`dualpath exec p0e0 -- python kv_peer.py ...`, or
`tb.popen(...)` from a test): $DUALPATH_IFACE names the engine's CNIC, the only interface
its bytes may use. The two exchange their NIXL metadata through whoever started them: each
prints `md <hex>` on stdout and reads the other's `md <hex>` line from stdin. Every result is
one JSON line on stdout; every wait is bounded.

The transport agent is the testbed's (dualpath.transport.Agent): it sets the UCX environment
that makes the bytes cross the emulated NIC (UCX_TLS=tcp, UCX_NET_DEVICES, ...) and listens
in the kv port range, so the bytes are marked AF11 and land in the CNIC's kv HTB class.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

import numpy as np

from dualpath.transport import Agent, contiguous_descs

TIMEOUT_S = 60.0
DESCRIPTORS = 16  # one NIXL request of 16 descriptors, like one layer's Layer Blocks


def say(**kw) -> None:
    print(json.dumps(kw), flush=True)


def exchange(agent: Agent) -> str:
    """Print our metadata, read the peer's, load it; return the peer's agent name."""
    print(f"md {agent.metadata().hex()}", flush=True)
    line = sys.stdin.readline()
    if not line.startswith("md "):
        raise SystemExit(f"expected the peer's metadata on stdin, got {line[:40]!r}")
    return agent.add_peer(bytes.fromhex(line[3:].strip()))


def target(nbytes: int, iface: str) -> None:
    # The passive side serves READs in software (UCX over TCP): it needs NIXL's progress thread.
    with Agent("user-target", iface, "kv", timeout_s=TIMEOUT_S) as agent:
        buf = np.zeros(nbytes, dtype=np.uint8)
        agent.register("buf", buf)
        peer = exchange(agent)
        agent.wait_notif(peer, b"written")  # the WRITE has landed
        say(role="target", received_sha256=hashlib.sha256(buf).hexdigest())
        agent.wait_notif(peer, b"done")  # the READ back is over: safe to go


def initiator(nbytes: int, iface: str, seed: int) -> None:
    with Agent("user-initiator", iface, "kv", progress_thread=False, timeout_s=TIMEOUT_S) as agent:
        src = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
        back = np.zeros(nbytes, dtype=np.uint8)
        agent.register("src", src)
        agent.register("back", back)
        peer = exchange(agent)
        descs = contiguous_descs(nbytes, DESCRIPTORS)
        w = agent.write(peer, "src", "buf", descs, notif=b"written")
        r = agent.read(peer, "back", "buf", descs)
        agent.send_notif(peer, b"done")
        say(role="initiator", sent_sha256=hashlib.sha256(src).hexdigest(), exact=bool(np.array_equal(src, back)),
            write_s=w.total_s, read_s=r.total_s, transport=agent.transport_in_use)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("role", choices=["target", "initiator"])
    ap.add_argument("--bytes", type=int, default=16 << 20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--iface", default=os.environ.get("DUALPATH_IFACE", ""),
                    help="default: $DUALPATH_IFACE, which `dualpath exec` and Testbed.popen set")
    a = ap.parse_args()
    if not a.iface:
        raise SystemExit("kv_peer: no interface: run it in a testbed namespace, or give --iface")
    if a.role == "target":
        target(a.bytes, a.iface)
    else:
        initiator(a.bytes, a.iface, a.seed)


if __name__ == "__main__":
    main()
