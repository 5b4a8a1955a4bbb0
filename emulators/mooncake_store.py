"""A Mooncake Store storage host: `mooncake_master` (on the first storage host) and one DRAM
segment of the store's capacity, mounted by a Mooncake client that serves it over its transfer
engine. Started like the 3FS-like store's server (emulators/kvstore/launch.ServerProcess), it
prints `LISTENING ip:port` (its master's address) once the segment is mounted, and runs until
SIGTERM. The master dies with it (PR_SET_PDEATHSIG), so a killed storage host leaves nothing.

    python -m emulators.mooncake_store --listen IP:PORT --root DIR --capacity-bytes N [--master IP:PORT]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

MASTER_PORT = 50051  # mooncake_master's own default; each storage host is a namespace of its own
MASTER_START_S = 30.0
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def start_master(ip: str, port: int, wheel: Path, log: Path) -> subprocess.Popen:
    """mooncake_master bound to ip:port; returns once it accepts connections."""
    proc = subprocess.Popen([str(wheel / "mooncake_master"), f"--rpc_address={ip}", f"--rpc_port={port}",
                             "--enable_metric_reporting=false", f"--metrics_host={ip}"],
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            preexec_fn=_die_with_parent)
    deadline = time.monotonic() + MASTER_START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mooncake_master exited with {proc.returncode}; see {log}")
        try:
            socket.create_connection((ip, port), timeout=0.5).close()
            return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"mooncake_master did not listen on {ip}:{port} within {MASTER_START_S:.0f} s; see {log}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--listen", required=True, help="IP[:PORT] of the storage NIC (PORT: the master's)")
    ap.add_argument("--root", required=True, help="folder for the master's log")
    ap.add_argument("--capacity-bytes", type=int, required=True, help="bytes of the DRAM segment it mounts")
    ap.add_argument("--block-bytes", type=int, default=0, help="accepted for the 3FS-like server's interface")
    ap.add_argument("--master", default=None, help="join this master (IP:PORT) instead of starting one")
    a = ap.parse_args(argv)
    from dualpath.transport.mooncake import configure, need_mooncake

    wheel = Path(need_mooncake())
    ip, _, port = a.listen.partition(":")
    root = Path(a.root)
    root.mkdir(parents=True, exist_ok=True)
    master = None
    if a.master is None:
        port_n = int(port) if port and port != "0" else MASTER_PORT
        master = start_master(ip, port_n, wheel, root / "mooncake_master.log")
        a.master = f"{ip}:{port_n}"
    configure()  # its transfer engine's ports in the kv range
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    if store.setup(ip, "P2PHANDSHAKE", a.capacity_bytes, 16 << 20, "tcp", "", a.master) != 0:
        print(f"mooncake_store: could not mount a {a.capacity_bytes}-byte segment at master {a.master}", file=sys.stderr)
        return 1
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    print(f"LISTENING {a.master}", flush=True)
    while not stop:
        signal.pause()
    store.close()
    if master is not None:
        master.terminate()
        master.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
