"""Run inside a node's host namespace: write N blocks to the store, then time reading them back.

    python -m testbed.cluster.store_probe --store 10.78.0.5:7000 --blocks 256 --block-bytes 262144

Prints one JSON line: the read throughput (payload GB/s) and whether every byte came back.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from dualpath.store.client import StoreClient
from dualpath.store.keys import chain_keys


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", required=True, help="comma-separated host:port")
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--block-bytes", type=int, default=256 << 10)
    ap.add_argument("--namespace", default="probe")
    a = ap.parse_args()
    keys = chain_keys(np.arange(a.blocks * 16), 16, namespace=a.namespace.encode())
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, a.blocks * a.block_bytes, dtype=np.uint8)
    out = np.zeros_like(data)
    with StoreClient(a.store.split(","), a.block_bytes) as c:
        c.put_many([(k, data[i * a.block_bytes:(i + 1) * a.block_bytes]) for i, k in enumerate(keys)])
        t0 = time.perf_counter()
        c.get_many(keys, out, [i * a.block_bytes for i in range(a.blocks)])
        dt = time.perf_counter() - t0
    print(json.dumps({"read_GBps": data.nbytes / dt / 1e9, "bytes": int(data.nbytes), "seconds": dt,
                      "exact": bool(np.array_equal(out, data))}), flush=True)


if __name__ == "__main__":
    main()
