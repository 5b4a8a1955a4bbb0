"""Store read throughput against fio on the same disk (DESIGN.md section 6).

What is compared, and why:
  * store_cold_gbps: get_many of every block over loopback TCP into one
    reusable buffer, after evicting the block files from the page cache with
    posix_fadvise(DONTNEED) (per file, so no root and no effect on anyone
    else's cache). Every byte therefore comes from the disk, then crosses the
    server, loopback TCP and the client's CRC check.
  * fio_direct_gbps: fio sequential read with O_DIRECT (bs 1 MiB, libaio,
    iodepth 16) of a file of the same size in the same directory: what the
    disk itself delivers, with no page cache to flatter it. This is the
    reference of the acceptance ratio (ratio = store_cold / fio_direct).
  * fio_buffered_gbps: fio sequential buffered read, cache invalidated first,
    one request at a time (psync): the page-cache path the store also uses,
    for context.
  * store_warm_gbps: get_many with the blocks already cached: not a disk
    number (it measures loopback, copies and CRC), reported so the two costs
    can be told apart.
  * loopback_floor_gbps: the same bytes, cached, sendfile()d over loopback
    TCP into recv_into() with no protocol and no CRC: the price of crossing a
    socket at all on this machine. floor_ratio (floor / fio_direct) bounds
    the ratio any TCP store could reach here while the CPU is the limit;
    store_warm against the floor is what the store itself (protocol, one file
    per block, CRC) costs.
Comparing a warm store with fio, or a cold store with a cached fio, would
measure memory against disk, so the ratio only uses the cold/direct pair.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from dualpath.store.client import StoreClient
from dualpath.store.keys import chain_keys
from dualpath.store.striping import server_index

FIO = "/usr/bin/fio"


def _evict(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _fio_gbps(path: Path, size: int, *, direct: bool, iodepth: int, fio_bin: str, timeout_s: float) -> float:
    args = [
        fio_bin,
        "--name=seqread",
        f"--filename={path}",
        "--rw=read",
        "--bs=1M",
        f"--size={size}",
        "--output-format=json",
    ]
    if direct:
        args += ["--direct=1", "--ioengine=libaio", f"--iodepth={iodepth}"]
    else:
        args += ["--direct=0", "--invalidate=1", "--ioengine=psync"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s, check=True).stdout
    # fio may print warnings before the JSON document.
    job = json.loads(out[out.index("{") :])["jobs"][0]
    return job["read"]["bw_bytes"] / 1e9


def _loopback_floor_gbps(path: Path, size: int, timeout_s: float) -> float:
    """sendfile() a cached file over loopback TCP into recv_into(), nothing else.

    The least any TCP store must pay on this machine (no disk, no protocol, no
    CRC, no per-block files): separates the cost of crossing a socket from
    the cost of the store itself.
    """
    chunk = 1 << 20
    with open(path, "rb", buffering=0) as f:  # into the page cache first
        scratch = bytearray(chunk)
        while f.readinto(scratch):
            pass
    with socket.create_server(("127.0.0.1", 0)) as lsock:
        lsock.settimeout(timeout_s)
        result: list[BaseException] = []

        def send() -> None:
            try:
                conn, _ = lsock.accept()
                with conn, open(path, "rb") as f:
                    conn.sendfile(f, 0, size)
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                result.append(exc)

        th = threading.Thread(target=send, daemon=True)
        th.start()
        with socket.create_connection(lsock.getsockname(), timeout=timeout_s) as sock:
            view = memoryview(bytearray(chunk))
            t0 = time.perf_counter()
            got = 0
            while got < size:
                k = sock.recv_into(view, min(chunk, size - got))
                if k == 0:
                    raise RuntimeError("loopback sender stopped early")
                got += k
            dt = time.perf_counter() - t0
        th.join(timeout_s)
        if result:
            raise result[0]
    return size / 1e9 / dt


def bench_store_vs_fio(
    work_dir: str | os.PathLike[str],
    *,
    total_bytes: int = 512 << 20,
    block_bytes: int = 1 << 20,
    n_servers: int = 1,
    repeats: int = 5,
    buffer_bytes: int = 128 << 20,
    fio_bin: str = FIO,
    fio_iodepth: int = 16,
    timeout_s: float = 300.0,
) -> dict[str, Any]:
    """Measure store reads vs fio on the disk holding `work_dir`; returns the numbers and ratio.

    Servers run as local subprocesses on 127.0.0.1 (unshaped). Everything it
    creates lives in a temp dir under work_dir and is removed at the end.
    """
    from emulators.kvstore.launch import ServerProcess

    n_blocks = max(1, total_bytes // block_bytes)
    total = n_blocks * block_bytes
    per_batch = max(1, min(n_blocks, buffer_bytes // block_bytes))
    deadline = time.monotonic() + timeout_s
    tmp = Path(tempfile.mkdtemp(prefix="dpt-storebench-", dir=work_dir))
    servers = [ServerProcess(tmp / f"srv{i}", capacity_bytes=2 * total + (64 << 20)) for i in range(n_servers)]
    try:
        for s in servers:
            s.start()
        keys = chain_keys(np.arange(n_blocks * 16, dtype=np.int64), 16, namespace=b"storebench")
        rng = np.random.default_rng(1)
        base = rng.integers(0, 256, size=block_bytes, dtype=np.uint8)
        with StoreClient([s.address for s in servers], block_bytes) as client:
            _write_blocks(client, keys, per_batch, base)
            files = [servers[server_index(k, n_servers)].root / "blocks" / k[:2] / k for k in keys]
            buf = np.empty(per_batch * block_bytes, dtype=np.uint8)
            buf.fill(0)  # fault the pages in now, not inside the timed reads

            def read_all() -> float:
                t0 = time.perf_counter()
                for start in range(0, n_blocks, per_batch):
                    client.get_many(keys[start : start + per_batch], buf)
                return total / 1e9 / (time.perf_counter() - t0)

            # fio's file sits beside the blocks, so both read the same disk.
            fio_file = tmp / "fio.dat"

            def left() -> float:
                return max(10.0, deadline - time.monotonic())

            fio_args = dict(fio_bin=fio_bin, iodepth=fio_iodepth)
            _fio_gbps(fio_file, total, direct=True, timeout_s=left(), **fio_args)  # lays the file out; not counted
            # Interleave store and fio runs so both see the same background load
            # (the machine is shared); the ratio is the median of the pairs.
            cold, warm, direct, floor = [], [], [], []
            for _ in range(repeats):
                if time.monotonic() > deadline:
                    raise TimeoutError("store benchmark ran out of time")
                _evict(files)
                cold.append(read_all())
                warm.append(read_all())  # now cached
                direct.append(_fio_gbps(fio_file, total, direct=True, timeout_s=left(), **fio_args))
                floor.append(_loopback_floor_gbps(fio_file, total, timeout_s=left()))
            # Spot check: the last batch read is byte-exact.
            last = n_blocks - 1 - ((n_blocks - 1) % per_batch)
            i = n_blocks - 1
            got = buf[(i - last) * block_bytes : (i - last + 1) * block_bytes]
            if int.from_bytes(got[:8].tobytes(), "little") != i or not np.array_equal(got[8:], base[8:]):
                raise RuntimeError("store benchmark read back wrong bytes")
        buffered = _fio_gbps(fio_file, total, direct=False, timeout_s=left(), **fio_args)
    finally:
        for s in servers:
            s.kill()
        shutil.rmtree(tmp, ignore_errors=True)

    return _summary(cold, warm, direct, floor, buffered, block_bytes, total, n_servers, fio_iodepth)


def _write_blocks(client: StoreClient, keys: list[str], per_batch: int, base: np.ndarray) -> None:
    """Block i is `base` with i in its first 8 bytes, so that every block is distinct."""
    for start in range(0, len(keys), per_batch):
        batch = []
        for i in range(start, min(len(keys), start + per_batch)):
            blk = base.copy()
            blk[:8] = np.frombuffer(i.to_bytes(8, "little"), dtype=np.uint8)
            batch.append((keys[i], blk))
        client.put_many(batch)


def _summary(cold: list[float], warm: list[float], direct: list[float], floor: list[float], buffered: float,
             block_bytes: int, total: int, n_servers: int, fio_iodepth: int) -> dict[str, Any]:
    ratios = [c / d for c, d in zip(cold, direct)]
    return {
        "store_cold_gbps": round(statistics.median(cold), 3),
        "fio_direct_gbps": round(statistics.median(direct), 3),
        "ratio": round(statistics.median(ratios), 3),
        "store_warm_gbps": round(statistics.median(warm), 3),
        "loopback_floor_gbps": round(statistics.median(floor), 3),
        "floor_ratio": round(statistics.median(floor) / statistics.median(direct), 3),
        "fio_buffered_gbps": round(buffered, 3),
        "store_cold_runs_gbps": [round(x, 3) for x in cold],
        "fio_direct_runs_gbps": [round(x, 3) for x in direct],
        "ratio_runs": [round(x, 3) for x in ratios],
        "block_bytes": block_bytes,
        "total_bytes": total,
        "n_servers": n_servers,
        # The store path costs CPU (about 1.1 CPU-s per GB here: receive copy,
        # CRC, sendfile, page cache) where O_DIRECT fio costs almost none, so a
        # busy machine lowers the ratio: record how busy it was.
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
        "fio": f"seq read bs=1M direct=1 libaio iodepth={fio_iodepth}",
        "store": "cold page cache (fadvise DONTNEED per block file), loopback TCP, CRC checked",
    }


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m testbed.calibrate.benches.store_fio", description="store reads vs fio on one disk")
    ap.add_argument("--dir", default=".", help="a directory on the disk to measure (a temp dir is made inside)")
    ap.add_argument("--total-mib", type=int, default=512)
    ap.add_argument("--block-kib", type=int, default=1024)
    ap.add_argument("--servers", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args(argv)
    res = bench_store_vs_fio(a.dir, total_bytes=a.total_mib << 20, block_bytes=a.block_kib << 10, n_servers=a.servers, repeats=a.repeats)
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
