"""CPU per post of NIXL's and Mooncake's KV transports, side by side on loopback.

One process holds two agents of each transport and WRITEs the same descriptor lists (4 KiB each,
strided like Full-Block rows) with and without a notification, waiting for each post. It prints
the wall and the process CPU per post. This is what a layer's WRITE costs the testbed's cores on
each transport (docs/mooncake.md).

    .venv/bin/python scripts/transport_post_cost.py [--posts N]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one_batch(ndesc: int, posts: int) -> tuple[float, float]:
    """Mooncake's engine alone, a whole list as one batch waited for by `batch_transfer_sync`: what
    a post would cost if the wheel's status call read every task (the transport cannot use it)."""
    from dualpath.transport.mooncake import configure

    configure()
    from mooncake.engine import TransferEngine, TransferOpcode

    a, b = TransferEngine(), TransferEngine()
    for te in (a, b):
        te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    x, y = np.zeros(8 << 20, np.uint8), np.zeros(8 << 20, np.uint8)
    a.register_memory(x.ctypes.data, x.nbytes)
    b.register_memory(y.ctypes.data, y.nbytes)
    peer = f"127.0.0.1:{b.get_rpc_port()}"
    args = ([x.ctypes.data + i * 8192 for i in range(ndesc)], [y.ctypes.data + i * 8192 for i in range(ndesc)],
            [4096] * ndesc, TransferOpcode.Write)
    a.batch_transfer_sync(peer, *args)
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(posts):
        a.batch_transfer_sync(peer, *args)
    return (time.perf_counter() - t0) / posts, (time.process_time() - c0) / posts


def measure(kind: str, ndesc: int, notif: bool, posts: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds) per post; run in a fresh process per transport."""
    if kind == "mooncake-one-batch":
        return one_batch(ndesc, posts)
    if kind == "mooncake":
        from dualpath.transport.mooncake import MooncakeAgent

        a, b = MooncakeAgent("cost-a", "lo"), MooncakeAgent("cost-b", "lo")
    else:
        from dualpath.transport import Agent

        a = Agent("cost-a", "lo", port_range=(22900, 22949), progress_thread=False)
        b = Agent("cost-b", "lo", port_range=(22950, 22999))
    x, y = np.zeros(8 << 20, np.uint8), np.zeros(8 << 20, np.uint8)
    a.register("r", x)
    b.register("r", y)
    a.add_peer(b.metadata())
    b.add_peer(a.metadata())
    a.connect("cost-b")
    descs = [(i * 8192, i * 8192, 4096) for i in range(ndesc)]
    a.write("cost-b", "r", "r", descs)
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(posts):
        a.write("cost-b", "r", "r", descs, notif=f"n{i}" if notif else None)
        if notif:
            b.wait_notif("cost-a", f"n{i}")
    return (time.perf_counter() - t0) / posts, (time.process_time() - c0) / posts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--posts", type=int, default=300)
    ap.add_argument("--one", nargs=3, metavar=("KIND", "NDESC", "NOTIF"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        wall, cpu = measure(a.one[0], int(a.one[1]), a.one[2] == "1", a.posts)
        print(f"{wall * 1e3:.3f} {cpu * 1e3:.3f}")
        return 0
    print(f"{'transport':18} {'descriptors':>11} {'notify':>6} {'wall ms':>8} {'CPU ms':>7}  (per post, loopback)")
    for kind in ("nixl", "mooncake", "mooncake-one-batch"):
        for ndesc in (1, 16):
            for notif in ((False,) if kind == "mooncake-one-batch" else (False, True)):
                p = subprocess.run([sys.executable, __file__, "--posts", str(a.posts), "--one", kind, str(ndesc),
                                    str(int(notif))], capture_output=True, text=True, timeout=300, cwd=REPO,
                                   env={**os.environ, "PYTHONPATH": REPO})
                if p.returncode != 0:
                    print(f"{kind}: failed: {p.stderr.strip()[-300:]}")
                    continue
                wall, cpu = p.stdout.split()
                print(f"{kind:18} {ndesc:>11} {'yes' if notif else 'no':>6} {float(wall):>8.2f} {float(cpu):>7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
