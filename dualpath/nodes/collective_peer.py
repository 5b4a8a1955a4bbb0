"""An engine's collective responder: the expert side of its group's AllToAll, as a process.

The engine starts it in its own namespace (so it binds the engine's CNIC address) and it lives
as long as the engine does. It is a process of its own, not a thread of the engine, so that a
peer's dispatch is answered at once even while the engine's Python thread computes (a thread
would wait for the engine's GIL, up to the 5 ms switch interval, and that wait would show up as
collective latency that no network caused). See dualpath/engines/collective.py.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys

from dualpath.engines.collective import Responder
from dualpath.traffic_classes import MODEL


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ip", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--tos", type=int, default=MODEL.tos_byte)
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    parent = os.getppid()
    r = Responder(args.ip, args.port, args.tos)
    sock = r.listen()
    print(f"listening {args.ip}:{args.port}", flush=True)
    r.serve(sock, alive=lambda: os.getppid() == parent)  # ends with its engine


if __name__ == "__main__":
    main()
