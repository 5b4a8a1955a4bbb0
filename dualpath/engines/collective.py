"""Model-class collectives: the AllToAll an engine's forward pass runs on every layer.

The engines of a group (the prefill engines; each decode node's engines) stand for the GPUs of
the target's expert-parallel group. On every layer of a prefill pass or decode step an engine
dispatches its tokens' share to each peer and waits for the combined outputs back, over its CNIC,
in the model class (IP_TOS = EF, set on our own sockets), and the pass waits for it. The bytes
per token come from the target (emulators/gpu/collectives.py) scaled like KV, so a collective's
real duration on the emulated links is its emulated duration times the dilation, as a KV load's is.

Why our own sockets and not torch.distributed (gloo): gloo would bind to the CNIC (it is the
engine namespace's only interface), but every gloo collective needs all ranks of the group to
enter it in lock step. The testbed's engines run data-parallel passes of their own, at their own
times; a rank with no work would have to run dummy passes, which nothing here schedules. So each
exchange is a dispatch to each peer's *responder* (dualpath/nodes/collective_peer.py, a small
process beside the engine that stands for the GPU's expert side: it takes the tokens and sends the
combine back at once) and the combine back from it. Per link it moves what the AllToAll moves;
it does not make the sender wait for the slowest rank, which a real AllToAll would.

The payload is stand-in bytes (zeros): the real model computes on real data locally; the wire
carries the volume and the timing, not the hidden states.

Wire format, per message on a persistent TCP connection: a header (payload bytes, reply bytes,
sequence number; network order), the payload; the responder answers with the reply bytes.
"""
from __future__ import annotations

import selectors
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

from dualpath.traffic_classes import MODEL

HEADER = struct.Struct("!IIQ")  # payload bytes, reply bytes, sequence
MAX_MESSAGE_BYTES = 256 << 20  # one message's payload or reply; a larger header is refused
CHUNK = 1 << 20  # the zero buffer each send and receive works through
CONNECT_TIMEOUT_S = 30.0
IO_TIMEOUT_S = 60.0  # one collective may take this long before it fails loudly


@dataclass(frozen=True)
class CollectiveConfig:
    """What an engine needs to run its group's collective (sent by the testbed as JSON)."""

    port: int  # every engine's responder listens on this port on its CNIC address
    peers: tuple[str, ...]  # the CNIC addresses of the group's other engines
    dispatch_per_token: float  # bytes this engine sends per token per layer, to all peers together
    combine_per_token: float  # bytes it receives back per token per layer
    tos: int = MODEL.tos_byte

    def __post_init__(self) -> None:
        if not 1 <= self.port <= 65535:
            raise ValueError(f"collective port must be in 1..65535, got {self.port!r}")
        if self.dispatch_per_token < 0 or self.combine_per_token < 0:
            raise ValueError("collective bytes per token must be >= 0")
        if not 0 <= self.tos <= 255:
            raise ValueError(f"tos must be a byte, got {self.tos!r}")

    @classmethod
    def from_dict(cls, d: dict) -> "CollectiveConfig":
        return cls(int(d["port"]), tuple(str(p) for p in d["peers"]), float(d["dispatch_per_token"]),
                   float(d["combine_per_token"]), int(d.get("tos", MODEL.tos_byte)))

    def to_dict(self) -> dict:
        return {"port": self.port, "peers": list(self.peers), "dispatch_per_token": self.dispatch_per_token,
                "combine_per_token": self.combine_per_token, "tos": self.tos}

    def sizes(self, n_tokens: int) -> list[tuple[int, int]]:
        """(bytes sent, bytes received back) per peer for a layer of `n_tokens` tokens: the
        group's share split evenly over the peers (each peer hosts an equal part of the experts)."""
        if n_tokens < 0:
            raise ValueError(f"n_tokens must be >= 0, got {n_tokens!r}")
        send = split_evenly(round(n_tokens * self.dispatch_per_token), len(self.peers))
        back = split_evenly(round(n_tokens * self.combine_per_token), len(self.peers))
        return list(zip(send, back))


def split_evenly(total: int, parts: int) -> list[int]:
    """`total` as `parts` integers that differ by at most one and add up to it."""
    if parts <= 0:
        return []
    q, r = divmod(int(total), parts)
    return [q + (i < r) for i in range(parts)]


@dataclass
class CollectiveRecord:
    """One layer's collective, as its engine saw it (testbed seconds)."""

    t_start: float
    latency_s: float
    tokens: int
    sent: int
    received: int

    def to_dict(self) -> dict:
        return {"t": round(self.t_start, 6), "s": round(self.latency_s, 7), "tokens": self.tokens,
                "sent": self.sent, "received": self.received}


def _set_model_class(sock: socket.socket, tos: int) -> None:
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class CollectiveGroup:
    """The engine's side of its group's collective: `run(n_tokens)` once per layer.

    Connections to the peers' responders open on first use (bounded by CONNECT_TIMEOUT_S) and
    stay open. Every run is recorded in `log` until the caller takes it (`take_log`)."""

    def __init__(self, cfg: CollectiveConfig, now=time.monotonic) -> None:
        self.cfg = cfg
        self.now = now
        self._socks: list[socket.socket] = []
        self._seq = 0
        self._zeros = memoryview(bytes(CHUNK))
        self._sink = memoryview(bytearray(CHUNK))
        self.log: list[CollectiveRecord] = []
        self._lock = threading.Lock()  # a decode step's thread and the service may both touch log

    def _connect(self) -> None:
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        for peer in self.cfg.peers:
            while True:
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                _set_model_class(s, self.cfg.tos)  # before connect: the SYN is in the class too
                s.settimeout(IO_TIMEOUT_S)
                try:
                    s.connect((peer, self.cfg.port))
                    break
                except OSError as e:
                    s.close()
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"collective: no responder at {peer}:{self.cfg.port} within "
                                           f"{CONNECT_TIMEOUT_S:g} s ({e})") from None
                    time.sleep(0.05)
            self._socks.append(s)

    def run(self, n_tokens: int) -> CollectiveRecord:
        """Dispatch this layer's tokens to every peer and wait for every combine back."""
        if not self.cfg.peers or n_tokens <= 0:
            rec = CollectiveRecord(self.now(), 0.0, n_tokens, 0, 0)
            return rec
        if not self._socks:
            self._connect()
        sizes = self.cfg.sizes(n_tokens)
        t0 = self.now()
        self._seq += 1
        for s, (send, back) in zip(self._socks, sizes):
            s.sendall(HEADER.pack(send, back, self._seq))
        self._exchange(sizes)
        rec = CollectiveRecord(t0, self.now() - t0, n_tokens, sum(a for a, _ in sizes), sum(b for _, b in sizes))
        with self._lock:
            self.log.append(rec)
        return rec

    def _exchange(self, sizes: list[tuple[int, int]]) -> None:
        """Send every payload and receive every reply, all peers at once (a peer's reply may
        start while another's payload is still going out)."""
        sel = selectors.DefaultSelector()
        left_out = {s: a for s, (a, _) in zip(self._socks, sizes)}
        left_in = {s: b for s, (_, b) in zip(self._socks, sizes)}
        try:
            for s in self._socks:
                s.setblocking(False)
                sel.register(s, (selectors.EVENT_WRITE if left_out[s] else 0) | selectors.EVENT_READ)
            deadline = time.monotonic() + IO_TIMEOUT_S
            while any(left_out.values()) or any(left_in.values()):
                events = sel.select(timeout=max(0.0, deadline - time.monotonic()))
                if not events:
                    raise RuntimeError(f"collective: no progress within {IO_TIMEOUT_S:g} s")
                for key, mask in events:
                    s = key.fileobj
                    if mask & selectors.EVENT_WRITE and left_out[s]:
                        try:
                            n = s.send(self._zeros[:min(CHUNK, left_out[s])])
                        except BlockingIOError:
                            n = 0
                        left_out[s] -= n
                    if mask & selectors.EVENT_READ and left_in[s]:
                        try:
                            n = s.recv_into(self._sink, min(CHUNK, left_in[s]))
                        except BlockingIOError:
                            continue
                        if n == 0:
                            raise RuntimeError("collective: a responder closed its connection")
                        left_in[s] -= n
                    want = (selectors.EVENT_WRITE if left_out[s] else 0) | (selectors.EVENT_READ if left_in[s] else 0)
                    if want:
                        sel.modify(s, want)
                    else:
                        sel.unregister(s)
        finally:
            sel.close()
            for s in self._socks:
                s.setblocking(True)
                s.settimeout(IO_TIMEOUT_S)

    def take_log(self) -> list[dict]:
        with self._lock:
            out, self.log = self.log, []
        return [r.to_dict() for r in out]

    def close(self) -> None:
        for s in self._socks:
            s.close()
        self._socks.clear()


# --------------------------------------------------------------------------- the responder


def _recv_exact(conn: socket.socket, n: int, buf: memoryview) -> bool:
    """Read and discard n bytes; False if the peer closed first."""
    while n > 0:
        got = conn.recv_into(buf, min(len(buf), n))
        if got == 0:
            return False
        n -= got
    return True


def _serve_connection(conn: socket.socket, tos: int) -> None:
    _set_model_class(conn, tos)
    zeros = memoryview(bytes(CHUNK))
    sink = memoryview(bytearray(CHUNK))
    hdr = bytearray(HEADER.size)
    try:
        while True:
            view = memoryview(hdr)
            got = 0
            while got < HEADER.size:
                n = conn.recv_into(view[got:])
                if n == 0:
                    return
                got += n
            payload, reply, _seq = HEADER.unpack(hdr)
            if payload > MAX_MESSAGE_BYTES or reply > MAX_MESSAGE_BYTES:
                return  # not ours: drop the connection rather than read a bogus length
            if not _recv_exact(conn, payload, sink):
                return
            while reply > 0:
                n = conn.send(zeros[:min(CHUNK, reply)])
                reply -= n
    except OSError:
        return
    finally:
        conn.close()


@dataclass
class Responder:
    """The expert side of an engine: answers every peer's dispatch with its combine.

    One thread per connection (a group has a handful of peers). `serve` runs until `stop` is
    set or `alive()` turns false (checked every accept timeout)."""

    ip: str
    port: int
    tos: int = MODEL.tos_byte
    stop: threading.Event = field(default_factory=threading.Event)

    def listen(self) -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, self.tos)
        s.bind((self.ip, self.port))
        s.listen(64)
        s.settimeout(0.5)
        return s

    def serve(self, sock: socket.socket, alive=lambda: True) -> None:
        try:
            while not self.stop.is_set() and alive():
                try:
                    conn, _ = sock.accept()
                except socket.timeout:
                    continue
                conn.settimeout(None)
                threading.Thread(target=_serve_connection, args=(conn, self.tos), daemon=True,
                                 name="dpt-coll-conn").start()
        finally:
            sock.close()
