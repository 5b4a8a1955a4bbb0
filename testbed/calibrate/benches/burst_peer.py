"""The two ends of `dualpath bench burst`'s transfers, each run inside a testbed namespace.

`serve IP PORT BYTES REPEATS`: accept one connection; REPEATS times, read BYTES and acknowledge
with one byte. `send IP PORT BYTES REPEATS IDLE_S TOS`: REPEATS times, stay silent for IDLE_S, then
send BYTES and wait for the acknowledgement; print the durations (seconds) as a JSON list.
"""
from __future__ import annotations

import json
import socket
import sys
import time


def serve(ip: str, port: int, nbytes: int, repeats: int) -> None:
    with socket.create_server((ip, port)) as ls:
        ls.settimeout(30)
        conn, _ = ls.accept()
        with conn:
            conn.settimeout(60)
            for _ in range(repeats):
                got = 0
                while got < nbytes:
                    chunk = conn.recv(1 << 20)
                    if not chunk:
                        return
                    got += len(chunk)
                conn.sendall(b"k")


def send(ip: str, port: int, nbytes: int, repeats: int, idle_s: float, tos: int) -> None:
    data = b"\0" * nbytes
    deadline = time.monotonic() + 10
    while True:  # the server may still be starting
        try:
            s = socket.create_connection((ip, port), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    with s:
        s.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.settimeout(60)
        out = []
        for _ in range(repeats):
            time.sleep(idle_s)  # the bucket refills
            t0 = time.monotonic()
            s.sendall(data)
            if s.recv(1) != b"k":
                raise RuntimeError("the receiver closed before acknowledging")
            out.append(time.monotonic() - t0)
    print(json.dumps(out))


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "serve":
        serve(args[0], int(args[1]), int(args[2]), int(args[3]))
    elif cmd == "send":
        send(args[0], int(args[1]), int(args[2]), int(args[3]), float(args[4]), int(args[5]))
    else:
        raise SystemExit(f"burst_peer: unknown command {cmd!r}; expected serve or send")
