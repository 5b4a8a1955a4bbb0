"""What the two processes of a transport bench share: the control channel between them (ZeroMQ, msgpack, timeouts), the byte pattern they move and its digest."""
from __future__ import annotations

import hashlib

import msgpack
import numpy as np

from dualpath.transport.env import TransportError


MAX_CONTROL_MSGS = 10_000


class ControlError(TransportError):
    """The control channel to the peer process failed or timed out."""


class Control:
    """A ZeroMQ REQ (initiator) or REP (target) socket carrying msgpack dicts, with timeouts."""

    def __init__(self, role: str, ip: str, port: int, timeout_s: float):
        import zmq

        self._zmq = zmq
        self.ctx = zmq.Context.instance()
        self.role = role
        self.timeout_ms = int(timeout_s * 1000)
        self.sock = self.ctx.socket(zmq.REP if role == "target" else zmq.REQ)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://{ip}:{port}"
        if role == "target":
            self.sock.bind(self.endpoint)
        else:
            self.sock.connect(self.endpoint)

    def send(self, obj: dict) -> None:
        self.sock.send(msgpack.packb(obj, use_bin_type=True))

    def recv(self, timeout_s: float | None = None) -> dict:
        ms = self.timeout_ms if timeout_s is None else int(timeout_s * 1000)
        if not self.sock.poll(ms, self._zmq.POLLIN):
            raise ControlError(f"{self.role}: no control message on {self.endpoint} within {ms / 1000:.1f} s")
        return msgpack.unpackb(self.sock.recv(), raw=False)

    def call(self, obj: dict, timeout_s: float | None = None) -> dict:
        self.send(obj)
        rep = self.recv(timeout_s)
        if "error" in rep:
            raise ControlError(f"peer error on {obj.get('cmd')!r}: {rep['error']}")
        return rep

    def close(self) -> None:
        self.sock.close(0)


def pattern(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def digest(buf: np.ndarray, ranges) -> str:
    h = hashlib.sha256()
    for off, ln in ranges:
        h.update(memoryview(buf[int(off):int(off) + int(ln)]))
    return h.hexdigest()
