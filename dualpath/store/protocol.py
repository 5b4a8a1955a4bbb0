"""Wire protocol between store clients and storage servers (no pickle).

Every message is one frame:

    +----------------+---------------------------+----------------------+
    | u32 big-endian | msgpack map (<= 64 KiB)   | payload, `n` bytes   |
    | header length  | the control header        | (raw, only if n > 0) |
    +----------------+---------------------------+----------------------+

Requests (client -> server), each with a per-connection integer `id`:
    {"op": "put", "id", "key", "n", "crc", "algo"}  + n payload bytes
    {"op": "get", "id", "key"}
    {"op": "mget", "id", "keys": [...]}   # = gets with ids id, id+1, ...;
                                          # lets the server prefetch the batch
    {"op": "has", "id", "keys": [...], "verify": bool (optional)}
                                          # header + size checked; with verify
                                          # also each payload's CRC
    {"op": "delete", "id", "key"}
    {"op": "stat", "id"}
Replies (server -> client), in request order, echoing `id`:
    ok:    {"id", "ok": True, ...}; a get reply carries "n", "crc" and "algo"
           and is followed by the n payload bytes, a put reply carries "new"
           (stored now) and "repaired" (replaced a stored copy that failed
           its checks); neither: an intact copy was already there
    error: {"id", "ok": False, "err": code, "msg": text, "key": key-or-None}

The payload travels raw after the header so the server can sendfile() a block
file and the client can recv_into() the caller's buffer: no copy through
Python objects on either side. `crc` is the payload's checksum and `algo` its
algorithm (checksum.py: 2 = CRC-32C, 1 = CRC-32 of blocks stored before
CRC-32C). A put must carry algo 2; a get reply names the algo of the stored
block, and the client checks it on every read (end to end: disk, server and
wire). Version 2 added `algo`: a version-1 peer gets a clear error, never a
block checked with the wrong algorithm.
"""
from __future__ import annotations

import select
import socket
import struct
import time
from typing import Any

import msgpack

from .errors import PeerClosedError, ProtocolError

PROTOCOL_VERSION = 2  # 2: checksums name their algorithm ("algo")
_LEN = struct.Struct(">I")
MAX_HEADER_BYTES = 64 * 1024  # a header is control only; anything bigger is an attack or a bug
OPS = ("put", "get", "mget", "has", "delete", "stat")
MAX_MGET_KEYS = 128  # server limit per mget frame
MAX_ID = 1 << 62  # request ids are integers in [0, MAX_ID]; -1 is a reply to no request


def pack_frame(header: dict[str, Any]) -> bytes:
    body = msgpack.packb(header, use_bin_type=True)
    if len(body) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(body)} bytes exceeds {MAX_HEADER_BYTES}")
    return _LEN.pack(len(body)) + body


def recv_exact_into(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill `view` completely from the socket; EOF before that is a ProtocolError.

    With `deadline` (time.monotonic()), TimeoutError once it passes; each recv still waits
    at most the socket's own timeout, which is restored afterwards.
    """
    got, total = 0, len(view)
    own = sock.gettimeout() if deadline is not None else None
    try:
        while got < total:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{got} of {total} bytes before the deadline")
                sock.settimeout(left if own is None else min(own, left))
            n = sock.recv_into(view[got:], total - got)
            if n == 0:
                raise PeerClosedError(f"connection closed after {got} of {total} bytes")
            got += n
    finally:
        if deadline is not None:
            sock.settimeout(own)


def recv_header(sock: socket.socket, *, eof_ok: bool = False, deadline: float | None = None) -> dict[str, Any] | None:
    """Read one frame's header. Returns None on a clean EOF between frames if eof_ok.

    With `deadline`, the whole header must have arrived by then (TimeoutError otherwise).
    """
    prefix = bytearray(_LEN.size)
    view = memoryview(prefix)
    n = sock.recv_into(view, len(prefix))
    if n == 0:
        if eof_ok:
            return None
        raise PeerClosedError("connection closed while waiting for a header")
    if n < len(prefix):
        recv_exact_into(sock, view[n:], deadline)
    (length,) = _LEN.unpack(prefix)
    if length > MAX_HEADER_BYTES:
        raise ProtocolError(f"header length {length} exceeds {MAX_HEADER_BYTES}")
    if length == 0:
        raise ProtocolError("empty header (length 0)")
    body = bytearray(length)
    recv_exact_into(sock, memoryview(body), deadline)
    try:
        header = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"undecodable header ({type(exc).__name__}): {str(exc)[:80]}") from None
    if not isinstance(header, dict):
        raise ProtocolError("header is not a map")
    return header


def peek_header(sock: socket.socket) -> tuple[dict[str, Any], int] | None:
    """The next frame's header if the whole header has already arrived, with its size on the wire.

    Nothing is consumed and nothing waits: None when the header is not (yet)
    all there or does not decode, and the caller reads it the ordinary way
    later, which waits for it or reports the error. Lets a server look one
    request ahead while it is still answering the previous one.
    """
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    if not poller.poll(0):
        return None
    try:
        prefix = sock.recv(_LEN.size, socket.MSG_PEEK)  # readable: returns at once
        if len(prefix) < _LEN.size:
            return None
        (length,) = _LEN.unpack(prefix)
        if length > MAX_HEADER_BYTES:
            return None
        raw = sock.recv(_LEN.size + length, socket.MSG_PEEK)
    except (BlockingIOError, InterruptedError):
        return None
    if len(raw) < _LEN.size + length:
        return None
    try:
        header = msgpack.unpackb(raw[_LEN.size :], raw=False, strict_map_key=True)
    except Exception:  # msgpack raises several unrelated types; recv_header reports it
        return None
    return (header, len(raw)) if isinstance(header, dict) else None


def parse_address(addr: str | tuple[str, int]) -> tuple[str, int]:
    """'host:port' or '[v6]:port' or (host, port) -> (host, port)."""
    if isinstance(addr, tuple):
        host, port = addr
        return str(host), int(port)
    host, sep, port = addr.rpartition(":")
    if not sep or not host:
        raise ValueError(f"address {addr!r} is not host:port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
