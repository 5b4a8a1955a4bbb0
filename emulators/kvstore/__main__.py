"""`python -m emulators.kvstore`: one store server process (what ServerProcess starts on a storage host)."""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from dualpath.store.protocol import format_address
from emulators.kvstore.server import StoreServer, log


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m emulators.kvstore", description=__doc__.split("\n\n")[0])
    ap.add_argument("--listen", default="127.0.0.1:0", help="host:port to listen on (port 0: pick a free one)")
    ap.add_argument("--root", required=True, help="directory holding this server's blocks")
    ap.add_argument("--capacity-bytes", type=int, required=True, help="bytes of blocks (headers included) to accept")
    ap.add_argument("--max-block-bytes", type=int, default=256 << 20)
    ap.add_argument("--block-bytes", type=int, default=0,
                    help="the one block size this store holds (0: any size up to --max-block-bytes)")
    ap.add_argument("--max-conns", type=int, default=256, help="lowered at start to what RLIMIT_NOFILE carries")
    ap.add_argument("--max-conns-per-peer", type=int, default=64)
    ap.add_argument("--idle-timeout-s", type=float, default=30.0, help="close connections idle this long")
    ap.add_argument("--max-inflight-bytes", type=int, default=64 << 20, help="bound on buffered put payload")
    ap.add_argument("--verify-reads", action="store_true", help="also check payload CRCs on the server before sending")
    ap.add_argument("--server-id", default="")
    ap.add_argument("--log-level", default="WARNING")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    srv = StoreServer(
        args.root,
        args.capacity_bytes,
        args.listen,
        max_block_bytes=args.max_block_bytes,
        block_bytes=args.block_bytes,
        max_conns=args.max_conns,
        max_conns_per_peer=args.max_conns_per_peer,
        idle_timeout_s=args.idle_timeout_s,
        max_inflight_bytes=args.max_inflight_bytes,
        verify_reads=args.verify_reads,
        server_id=args.server_id,
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        host, port = srv.start()
    except (OSError, RuntimeError, ValueError) as exc:
        print(f"kvstore server: cannot start: {exc}", file=sys.stderr)
        return 2
    rec = srv.recovery
    print(f"LISTENING {format_address(host, port)}", flush=True)
    if rec is not None and rec.removed_temp_files:
        log.warning("startup removed %d stale temp files", rec.removed_temp_files)
    while not stop.wait(1.0):
        pass
    srv.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
