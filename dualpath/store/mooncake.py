"""A Mooncake Store client with the calls a host agent makes of the 3FS-like store's client
(`get_many`, `put_many`, `contains`), for topologies with `store: mooncake`.

Mooncake Store (the `mooncake-transfer-engine-non-cuda` wheel) keeps objects in DRAM segments
that storage hosts mount (emulators/mooncake_store.py); a master (`mooncake_master`) places them.
A client asks the master where a block is, then READs or WRITEs it with Mooncake's transfer engine
straight between the storage host's segment and the caller's registered buffer, so the bytes
cross the node's SNIC and the storage NIC, as the 3FS-like store's do.

Where its semantics differ from the 3FS-like store, and what the testbed does:
- **Durability.** A put is acknowledged once the block is in a storage host's DRAM, not on a disk:
  it survives a host agent or an engine, not a storage host's crash. The store faults (store-crash,
  disk-full, corrupt-block) are refused on it rather than run against guarantees it does not make.
- **Eviction.** Past a high watermark (90 % of the segments) the master evicts objects whose
  lease has ended. An evicted block reads as missing (`MissingBlockError`) and the request that
  needed it fails by name; the storage hosts mount the topology's store capacity, far above what
  a run writes, and the report's NIC bytes would show a re-read.
- **Integrity.** No checksum is stored. The testbed's own checks stand instead: every layer the
  engines load is compared against the PE's CRCs and the recomputation.
- **Replication.** One replica per block (the 3FS-like store stripes without replicas too).
- **Waiting.** The wheel's client waits for its own transfers by polling without pause: a
  `batch_get_into` in flight keeps a core busy for as long as the read takes (measured here: one
  core per reading host agent, so the dual-path modes went UNFAITHFUL at 92 % CPU). Reads here
  therefore ask the store where each block is (`batch_get_replica_desc`, which also leases it)
  and READ it with the store's own transfer engine, polled with sleeps. Puts keep
  `batch_put_from` (write-back is a few percent of the bytes).
- **"New" blocks.** A put of a key already stored succeeds without rewriting it; whether a block
  was new is asked of the master first (`batch_is_exist`), one round trip per flush.
"""
from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np

from dualpath.timeouts import scaled

from .errors import BadRequestError, MissingBlockError, StoreConnectionError, StoreError
from .keys import check_key

OBJECT_NOT_FOUND = -704  # Mooncake's ErrorCode for a key it does not hold
LOCAL_BUFFER_BYTES = 16 << 20  # the client's own staging buffer (unused: reads and writes go to ours)
READ_TIMEOUT_S = scaled(30.0)
MAX_POLL_SLEEP_S = 0.001


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


class MooncakeStoreClient:
    """Full Blocks of `block_bytes` in a Mooncake Store whose master is at `master` ("ip:port"),
    read into and written from `buffer` (registered with the client's transfer engine), from
    this node's storage NIC address `ip`."""

    def __init__(self, master: str, block_bytes: int, ip: str, buffer: np.ndarray,
                 timeout_s: float = READ_TIMEOUT_S) -> None:
        from dualpath.transport.mooncake import configure, need_mooncake

        need_mooncake()
        configure()  # its transfer engine's ports in the kv range, like the transport's
        from mooncake.engine import TransferEngine, TransferOpcode
        from mooncake.store import MooncakeDistributedStore

        self.block_bytes, self.timeout_s = block_bytes, timeout_s
        self.retries = 0  # Mooncake retries inside; nothing is retried here
        self._read_op = TransferOpcode.Read
        self._buf = buffer  # registered with Mooncake: kept alive as long as the client
        self._lo, self._hi = int(buffer.ctypes.data), int(buffer.ctypes.data) + buffer.nbytes
        self._te = TransferEngine()  # the store's engine too, so that reads can be polled here
        if self._te.initialize(ip, "P2PHANDSHAKE", "tcp", "") != 0:
            raise StoreConnectionError(f"Mooncake Store: its transfer engine did not start on {ip}")
        self._store = MooncakeDistributedStore()
        if self._store.setup(ip, "P2PHANDSHAKE", 0, LOCAL_BUFFER_BYTES, "tcp", "", master, self._te.get_engine()) != 0:
            raise StoreConnectionError(f"Mooncake Store: could not join the master at {master} from {ip}")
        if self._store.register_buffer(self._lo, buffer.nbytes) != 0:
            raise StoreError(f"Mooncake Store: could not register the {buffer.nbytes}-byte buffer")

    def _addresses(self, views: Sequence[memoryview], keys: Sequence[str]) -> list[int]:
        out = []
        for key, v in zip(keys, views):
            if len(v) != self.block_bytes:
                raise BadRequestError(f"block {key} has {len(v)} bytes, store blocks are {self.block_bytes}", key=key)
            a = _address(v)
            if not self._lo <= a <= self._hi - len(v):
                raise BadRequestError(f"block {key}: its bytes are outside the registered buffer", key=key)
            out.append(a)
        return out

    @staticmethod
    def _raise_first(results: Sequence[int], keys: Sequence[str], what: str) -> None:
        """The error of the first key whose result is an error, carrying every failure in .errors."""
        errors: dict[str, StoreError] = {}
        for key, r in zip(keys, results):
            if r < 0:
                errors[key] = (MissingBlockError(f"block {key} is not in the Mooncake Store", key=key)
                               if r == OBJECT_NOT_FOUND else
                               StoreError(f"Mooncake Store {what} of block {key} failed with error {r}", key=key))
        if errors:
            first = next(iter(errors.values()))
            first.errors = errors  # type: ignore[attr-defined]
            raise first

    def get_many(self, keys: Sequence[str], out: Any, offsets: Sequence[int] | None = None) -> None:
        """Read blocks into `out` (a view of the registered buffer) at `offsets` (default packed)."""
        keys = [check_key(k) for k in keys]
        mv = memoryview(out).cast("B")
        bb = self.block_bytes
        offs = list(offsets) if offsets is not None else [i * bb for i in range(len(keys))]
        if len(offs) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(offs)} offsets")
        if not keys:
            return
        views = [mv[o:o + bb] for o in offs]
        self._raise_first(self._read(keys, self._addresses(views, keys)), keys, "read")

    def _read(self, keys: list[str], addrs: list[int]) -> list[int]:
        """READ each block from where the master says it is; per block 0, or an error code."""
        where = self._store.batch_get_replica_desc(keys)  # leases them while they are read
        results = [OBJECT_NOT_FOUND] * len(keys)
        batches: dict[int, int] = {}
        for i, key in enumerate(keys):
            for rep in where.get(key, []):
                if rep.is_memory_replica():
                    d = rep.get_memory_descriptor().buffer_descriptor
                    if d.size != self.block_bytes:
                        results[i] = -1
                        break
                    b = self._te.batch_transfer_async(d.transport_endpoint, [addrs[i]], [d.buffer_address],
                                                      [self.block_bytes], self._read_op)
                    if b:
                        batches[i] = b
                    else:
                        results[i] = -1
                    break
        return self._await(batches, results)

    def _await(self, batches: dict[int, int], results: list[int]) -> list[int]:
        """Poll every batch to its end (a finished one is freed, so never asked again), sleeping
        between polls where Mooncake's own waiter would spin."""
        deadline, sleep = time.monotonic() + self.timeout_s, 0.0001
        while batches:
            for i, b in list(batches.items()):
                st = self._te.transfer_check_status(b)
                if st != 0:
                    results[i] = 0 if st == 1 else st
                    del batches[i]
            if not batches:
                break
            if time.monotonic() > deadline:
                raise StoreError(f"Mooncake Store: {len(batches)} block read(s) did not complete within "
                                 f"{self.timeout_s:.0f} s")
            time.sleep(sleep)
            sleep = min(2 * sleep, MAX_POLL_SLEEP_S)
        return results

    def put_many(self, items: Sequence[tuple[str, Any]]) -> list[bool]:
        """Store blocks; per block, True if it was not stored before."""
        keys = [check_key(k) for k, _ in items]
        if not keys:
            return []
        views = [memoryview(d).cast("B") for _, d in items]
        addrs = self._addresses(views, keys)
        new = [e != 1 for e in self._store.batch_is_exist(keys)]
        self._raise_first(self._store.batch_put_from(keys, addrs, [self.block_bytes] * len(keys)), keys, "write")
        return new

    def contains(self, keys: Sequence[str]) -> list[bool]:
        keys = [check_key(k) for k in keys]
        return [e == 1 for e in self._store.batch_is_exist(keys)] if keys else []

    def interrupt(self) -> None:
        """Nothing to cut: Mooncake's transfers end with its own timeouts."""

    def close(self) -> None:
        try:
            self._store.unregister_buffer(self._lo)
        finally:
            self._store.close()

    def __enter__(self) -> "MooncakeStoreClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
