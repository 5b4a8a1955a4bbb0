"""The storage server: a BlockStore behind the store wire protocol.

One thread per connection (requests on a connection are answered in order, so
a client may pipeline them); a bounded number of connections; payloads are
streamed in fixed chunks borrowed from a bounded pool, and get replies go out
with sendfile() straight from the block file, whose disk reads were started a
few MiB ahead (READAHEAD_BYTES), on into the client's next mget. Memory is
therefore bounded by max_conns * (small per-connection buffer) +
max_inflight_bytes, whatever the clients send.

    python -m emulators.kvstore.server --listen 127.0.0.1:0 --root DIR --capacity-bytes N

prints "LISTENING host:port" on stdout once it accepts connections.
"""
from __future__ import annotations

import argparse
import logging
import os
import queue
import select
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from dualpath.store.checksum import ALGO_NAMES, WRITE_ALGO
from dualpath.store.errors import (
    BadRequestError,
    ProtocolError,
    ServerBusyError,
    StoreError,
    short_repr,
)
from dualpath.store.keys import check_key
from dualpath.store.protocol import (
    MAX_MGET_KEYS,
    OPS,
    PROTOCOL_VERSION,
    format_address,
    pack_frame,
    parse_address,
    peek_header,
    recv_exact_into,
    recv_header,
)

from .storage import BlockHandle, BlockStore, RecoveryReport

log = logging.getLogger("emulators.kvstore.server")

DRAIN_BYTES = 64 * 1024  # per-connection buffer: fallback for puts when the pool is empty
# Bytes of upcoming blocks a connection keeps being read from disk ahead of the
# one it sends. Asking for a whole mget at once (32 MiB and more) made cold reads
# slower here: the next block's reads queue behind those of blocks needed much
# later. 8 MiB measured best (cold store reads 1.64 GB/s vs 1.34 all at once,
# 1.47 at 2 MiB, 1.36 at 32 MiB; 1 MiB blocks, interleaved runs).
READAHEAD_BYTES = 8 << 20
MAX_HAS_KEYS = 1024  # a has-request's keys also fit the 64 KiB header limit
MAX_VERIFY_KEYS = 128  # a verifying has reads every payload: as many blocks as one mget


class _BufferPool:
    """A fixed set of chunk buffers: the server's bound on in-flight payload bytes."""

    def __init__(self, chunk_bytes: int, max_inflight_bytes: int) -> None:
        self._free: queue.SimpleQueue[bytearray] = queue.SimpleQueue()
        for _ in range(max(1, max_inflight_bytes // chunk_bytes)):
            self._free.put(bytearray(chunk_bytes))

    def acquire(self, timeout: float) -> bytearray | None:
        try:
            return self._free.get(timeout=timeout)
        except queue.Empty:
            return None

    def release(self, buf: bytearray) -> None:
        self._free.put(buf)


class _CloseConnection(Exception):
    """The stream can no longer be trusted to be in sync: reply, then hang up."""


@dataclass
class _MgetBatch:
    """One mget's files, opened; read ahead and sent in key order, each fd closed once used."""

    rid: int
    keys: list[Any]
    items: list[int | StoreError | None]  # an open fd, the error to reply, or None once handed on
    hinted: int = 0  # items[:hinted] have had their reads started (in order)
    hinted_bytes: int = 0
    done_bytes: int = 0  # hinted bytes of the items already sent or answered
    sizes: list[int] = field(default_factory=list)  # bytes hinted per item, for items[:hinted]

    def close(self) -> None:
        for i, item in enumerate(self.items):
            self.items[i] = None
            if isinstance(item, int):
                os.close(item)


def _is_mget(req: dict[str, Any]) -> bool:
    """A well-formed mget frame (the checks _handle and _mget make before serving one)."""
    rid, n, keys = req.get("id"), req.get("n", 0), req.get("keys")
    return (
        req.get("op") == "mget"
        and isinstance(rid, int)
        and isinstance(n, int)
        and n == 0
        and isinstance(keys, list)
        and 0 < len(keys) <= MAX_MGET_KEYS
    )


def _sendfile_all(conn: socket.socket, fd: int, offset: int, count: int, timeout_s: float) -> None:
    """Send `count` bytes of file `fd` from `offset` with sendfile(): page cache to socket, no user copy.

    The socket has a timeout (so it is non-blocking underneath); wait for
    writability with poll() on EAGAIN, at most timeout_s per wait.
    """
    out = conn.fileno()
    poller = None
    while count > 0:
        try:
            sent = os.sendfile(out, fd, offset, count)
        except BlockingIOError:
            if poller is None:
                poller = select.poll()
                poller.register(out, select.POLLOUT)
            if not poller.poll(timeout_s * 1000):
                raise TimeoutError("client stopped reading")
            continue
        if sent == 0:  # the file is shorter than its header said: the stream is now broken
            raise _CloseConnection
        offset += sent
        count -= sent


class StoreServer:
    def __init__(
        self,
        root: str | os.PathLike[str],
        capacity_bytes: int,
        listen: str | tuple[str, int] = ("127.0.0.1", 0),
        *,
        max_block_bytes: int = 256 << 20,
        max_conns: int = 64,
        chunk_bytes: int = 1 << 20,
        max_inflight_bytes: int = 64 << 20,
        verify_reads: bool = False,
        idle_timeout_s: float = 600.0,
        server_id: str = "",
        readahead_bytes: int = READAHEAD_BYTES,
    ) -> None:
        self.store = BlockStore(root, capacity_bytes, max_block_bytes)
        self.listen = parse_address(listen)
        self.max_conns = max_conns
        self.verify_reads = verify_reads
        self.idle_timeout_s = idle_timeout_s
        self.server_id = server_id
        if readahead_bytes < 0:
            raise ValueError("readahead_bytes must be >= 0")
        self.readahead_bytes = readahead_bytes
        self._pool = _BufferPool(chunk_bytes, max_inflight_bytes)
        self._stop = threading.Event()
        self._lsock: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self._refusers = threading.BoundedSemaphore(8)  # threads answering "busy" at once
        self.recovery: RecoveryReport | None = None

    # ---- lifecycle -------------------------------------------------------
    @property
    def address(self) -> tuple[str, int]:
        if self._lsock is None:
            raise RuntimeError("server not started")
        host, port = self._lsock.getsockname()[:2]
        return host, port

    def start(self) -> tuple[str, int]:
        """Recover the root, bind, and accept in a background thread."""
        self.recovery = self.store.open()
        log.info("recovered %s", self.recovery)
        host, port = self.listen
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        lsock = socket.socket(family, socket.SOCK_STREAM)
        try:
            lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            lsock.bind((host, port))
            lsock.listen(128)
            lsock.settimeout(0.5)  # so the accept loop notices stop() promptly
        except BaseException:
            lsock.close()
            self.store.close()
            raise
        self._lsock = lsock
        self._accept_thread = threading.Thread(target=self._accept_loop, name="kvstore-accept", daemon=True)
        self._accept_thread.start()
        return self.address

    def stop(self) -> None:
        self._stop.set()
        if self._lsock is not None:
            try:
                self._lsock.shutdown(socket.SHUT_RDWR)  # wakes a blocked accept() at once (Linux)
            except OSError:
                pass
        if self._accept_thread is not None:
            self._accept_thread.join(timeout=5.0)
        if self._lsock is not None:
            self._lsock.close()
        with self._conns_lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.store.close()

    def __enter__(self) -> "StoreServer":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- connections -----------------------------------------------------
    def _accept_loop(self) -> None:
        assert self._lsock is not None
        while not self._stop.is_set():
            try:
                conn, _peer = self._lsock.accept()
            except socket.timeout:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                self._stop.wait(0.05)  # e.g. EMFILE: back off, keep serving the connections we have
                continue
            with self._conns_lock:
                full = len(self._conns) >= self.max_conns
                if not full:
                    self._conns.add(conn)
            if full:
                if self._refusers.acquire(blocking=False):
                    threading.Thread(target=self._refuse, args=(conn,), name="kvstore-refuse", daemon=True).start()
                else:
                    conn.close()  # refusing too many already: just hang up
                continue
            threading.Thread(target=self._serve_conn, args=(conn,), name="kvstore-conn", daemon=True).start()

    def _refuse(self, conn: socket.socket) -> None:
        """Tell a client over the connection limit that the server is busy.

        The client's first request is read and dropped before closing: closing
        with unread data would send a RST, which can destroy the busy reply
        before the client reads it. At most 1 s and 1 MiB per refusal.
        """
        try:
            conn.settimeout(1.0)
            err = ServerBusyError(f"server at its limit of {self.max_conns} connections")
            conn.sendall(pack_frame({"id": -1, "ok": False, "err": err.code, "msg": str(err), "key": None}))
            conn.shutdown(socket.SHUT_WR)
            deadline, drained = time.monotonic() + 1.0, 0
            while drained < (1 << 20) and time.monotonic() < deadline:
                chunk = conn.recv(65536)
                if not chunk:
                    break
                drained += len(chunk)
        except OSError:
            pass
        finally:
            conn.close()
            self._refusers.release()

    def _serve_conn(self, conn: socket.socket) -> None:
        drain = bytearray(DRAIN_BYTES)
        ahead: list[_MgetBatch] = []  # at most one: the next mget, taken off the socket early (_send_batch)
        try:
            conn.settimeout(self.idle_timeout_s)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while not self._stop.is_set():
                try:
                    if ahead:  # already taken off the socket: its turn has come
                        self._send_batch(conn, ahead.pop(), drain, ahead)
                        continue
                    try:
                        req = recv_header(conn, eof_ok=True)
                    except ProtocolError:
                        return
                    if req is None:
                        return
                    self._handle(conn, req, drain, ahead)
                except _CloseConnection:
                    return
        except (OSError, ProtocolError) as exc:
            log.debug("connection ended: %s", exc)
        except Exception:  # a bug must cost one connection, never the server
            log.exception("unexpected error on a connection")
        finally:
            for batch in ahead:
                batch.close()
            with self._conns_lock:
                self._conns.discard(conn)
            conn.close()

    # ---- requests --------------------------------------------------------
    def _reply_error(self, conn: socket.socket, rid: Any, err: StoreError) -> None:
        conn.sendall(pack_frame({"id": rid, "ok": False, "err": err.code, "msg": str(err), "key": err.key}))

    def _handle(self, conn: socket.socket, req: dict[str, Any], drain: bytearray, ahead: list[_MgetBatch]) -> None:
        rid, op, n = req.get("id"), req.get("op"), req.get("n", 0)
        if not isinstance(rid, int) or not isinstance(n, int) or n < 0:
            self._reply_error(conn, rid if isinstance(rid, int) else -1, BadRequestError("request needs an int id and n >= 0"))
            raise _CloseConnection
        if op == "put":
            self._put(conn, rid, req, n, drain)
            return
        if n:  # only put carries a payload; the stream is out of sync otherwise
            self._reply_error(conn, rid, BadRequestError(f"op {op!r} carries no payload"))
            raise _CloseConnection
        try:
            if op == "get":
                self._get(conn, rid, req.get("key"), drain)
                return
            if op == "mget":
                self._mget(conn, rid, req, drain, ahead)
                return
            if op == "has":
                keys, verify = req.get("keys"), req.get("verify", False)
                if type(verify) is not bool:
                    raise BadRequestError(f"has: field 'verify' must be true or false, got {short_repr(verify)}")
                most = MAX_VERIFY_KEYS if verify else MAX_HAS_KEYS
                if not isinstance(keys, list) or len(keys) > most:
                    raise BadRequestError(f"has: field 'keys' must be a list of at most {most} keys"
                                          f"{' with verify' if verify else ''}")
                keys = [check_key(k) for k in keys]
                have = [self.store.has(k, verify, memoryview(drain)) for k in keys]
                conn.sendall(pack_frame({"id": rid, "ok": True, "have": have}))
            elif op == "delete":
                deleted = self.store.delete(check_key(req.get("key")))
                conn.sendall(pack_frame({"id": rid, "ok": True, "deleted": deleted}))
            elif op == "stat":
                st: dict[str, Any] = dict(self.store.stats())
                st.update(id=rid, ok=True, v=PROTOCOL_VERSION, server_id=self.server_id)
                conn.sendall(pack_frame(st))
            else:
                raise BadRequestError(f"unknown op {op!r}; expected one of {OPS}")
        except StoreError as err:
            self._reply_error(conn, rid, err)

    def _mget(self, conn: socket.socket, rid: int, req: dict[str, Any], scratch: bytearray, ahead: list[_MgetBatch]) -> None:
        """Several gets in one frame; replies carry ids rid, rid+1, ... in key order."""
        if not _is_mget(req):
            # The client waits for one reply per key it thinks it asked for: hang up rather than let it wait.
            self._reply_error(conn, rid, BadRequestError(f"mget needs a list of 1..{MAX_MGET_KEYS} keys"))
            raise _CloseConnection
        self._send_batch(conn, self._open_batch(rid, req["keys"]), scratch, ahead)

    def _open_batch(self, rid: int, keys: list[Any]) -> _MgetBatch:
        """Open every file of an mget (a missing or bad key becomes its error reply)."""
        batch = _MgetBatch(rid, keys, [])
        try:
            for key in keys:
                try:
                    batch.items.append(self.store.open_fd(check_key(key)))
                except StoreError as err:
                    batch.items.append(err)
        except BaseException:
            batch.close()
            raise
        return batch

    def _read_ahead(self, batch: _MgetBatch, i: int, ahead: list[_MgetBatch]) -> None:
        """Start the disk reads (WILLNEED) of the blocks from batch.items[i] on, in send
        order (on into the batch ahead), until about readahead_bytes are being read.

        Knowing the coming blocks keeps the disk busy with a queue of requests
        on a cold read instead of waiting on one file at a time; keeping that
        queue short gets the block needed next first.
        """
        batches = [batch, *ahead]
        pending = sum(b.hinted_bytes - b.done_bytes for b in batches)
        for b in batches:
            # Block i itself always: its hint's size is what done_bytes counts once it is sent.
            while b.hinted < len(b.items) and (pending < self.readahead_bytes or (b is batch and b.hinted <= i)):
                item = b.items[b.hinted]
                size = self.store.prefetch_fd(item) if isinstance(item, int) else 0
                b.sizes.append(size)
                b.hinted += 1
                b.hinted_bytes += size
                pending += size

    def _send_batch(self, conn: socket.socket, batch: _MgetBatch, scratch: bytearray, ahead: list[_MgetBatch]) -> None:
        """Validate and send a batch's blocks in order; closes the batch.

        Before each block it looks for the client's next mget already waiting
        on the socket and, if there is one, opens it at once, so that reading
        ahead runs on into it: otherwise a batch's disk reads would only start
        once the previous batch had been sent in full, and a cold read would
        alternate between waiting on the disk and on the network instead of
        overlapping them (1 MiB blocks: 1.16 vs 0.89 GB/s here). One batch
        ahead at most, so a connection holds at most 2 * MAX_MGET_KEYS open
        files.
        """
        try:
            for i, key in enumerate(batch.keys):
                if not ahead:
                    nxt = self._early_mget(conn)
                    if nxt is not None:
                        ahead.append(nxt)
                self._read_ahead(batch, i, ahead)
                item, batch.items[i] = batch.items[i], None  # the handle now owns the fd
                batch.done_bytes += batch.sizes[i]
                if isinstance(item, StoreError):
                    self._reply_error(conn, batch.rid + i, item)
                    continue
                assert isinstance(item, int)
                try:
                    handle = self.store.check_block(key, item)
                except StoreError as err:
                    self._reply_error(conn, batch.rid + i, err)
                    continue
                self._send_block(conn, batch.rid + i, handle, scratch)
        finally:
            batch.close()

    def _early_mget(self, conn: socket.socket) -> _MgetBatch | None:
        """The next request, its files opened, if it is an mget that has fully arrived; else None.

        Anything else (another op, a frame still arriving, a malformed one)
        stays on the socket for the ordinary path, in order.
        """
        peeked = peek_header(conn)
        if peeked is None or not _is_mget(peeked[0]):
            return None
        req, size = peeked
        recv_exact_into(conn, memoryview(bytearray(size)))  # consume exactly the peeked frame
        return self._open_batch(req["id"], req["keys"])

    def _get(self, conn: socket.socket, rid: int, key: Any, scratch: bytearray) -> None:
        try:
            handle = self.store.open_block(check_key(key))
        except StoreError as err:
            self._reply_error(conn, rid, err)
            return
        self._send_block(conn, rid, handle, scratch)

    def _send_block(self, conn: socket.socket, rid: int, handle: BlockHandle, scratch: bytearray) -> None:
        """Reply header, then the payload straight from the file. Closes the handle."""
        try:
            if self.verify_reads:
                try:
                    self.store.verify(handle, memoryview(scratch))
                except StoreError as err:
                    self._reply_error(conn, rid, err)
                    return
            # MSG_MORE: let the header share a segment with the first payload bytes
            # (only when payload follows, or the header would wait for the cork timer).
            flags = socket.MSG_MORE if handle.payload_len else 0
            reply = {"id": rid, "ok": True, "n": handle.payload_len, "crc": handle.payload_crc, "algo": handle.algo}
            conn.sendall(pack_frame(reply), flags)
            _sendfile_all(conn, handle.fd, handle.payload_offset, handle.payload_len, self.idle_timeout_s)
        finally:
            handle.close()

    def _put(self, conn: socket.socket, rid: int, req: dict[str, Any], n: int, drain: bytearray) -> None:
        key, crc, algo = req.get("key"), req.get("crc"), req.get("algo")
        if n > self.store.max_block_bytes:
            # Not worth draining; the client gets a reason and a closed connection.
            self._reply_error(conn, rid, BadRequestError(f"block of {n} bytes exceeds max {self.store.max_block_bytes}", key=key if isinstance(key, str) else None))
            raise _CloseConnection
        err: StoreError | None = None
        txn = None
        try:
            if not isinstance(crc, int):
                raise BadRequestError("put needs an int crc", key=key if isinstance(key, str) else None)
            if algo != WRITE_ALGO:
                # A client of protocol v1 sends a CRC-32 without "algo": storing it would fail every read.
                raise BadRequestError(
                    f"put needs algo {WRITE_ALGO} ({ALGO_NAMES[WRITE_ALGO]}), got {algo!r}; client older than store protocol v2?",
                    key=key if isinstance(key, str) else None,
                )
            txn = self.store.begin_put(check_key(key), n, crc, memoryview(drain))
        except StoreError as e:
            err = e
        buf = self._pool.acquire(timeout=5.0) if (txn is not None and n) else None
        view = memoryview(buf if buf is not None else drain)
        try:
            remaining = n
            while remaining:  # always consume the whole payload to stay in sync
                k = conn.recv_into(view, min(len(view), remaining))
                if k == 0:
                    raise ProtocolError(f"connection closed with {remaining} payload bytes to go")
                remaining -= k
                if txn is not None:
                    try:
                        txn.write(view[:k])
                    except StoreError as e:
                        err = e
                        txn.abort()
                        txn = None
            status = "exists"
            if txn is not None:
                status = txn.commit()
                txn = None
        except ProtocolError:
            raise  # the stream is broken; _serve_conn hangs up
        except StoreError as e:
            err = e
        finally:
            if txn is not None:
                txn.abort()  # connection lost mid-payload: nothing becomes visible
            if buf is not None:
                self._pool.release(buf)
        if err is not None:
            self._reply_error(conn, rid, err)
        else:
            # "new": stored now; "repaired": replaced a damaged block; neither: an intact one was there.
            conn.sendall(pack_frame({"id": rid, "ok": True, "new": status == "new", "repaired": status == "repaired"}))




def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m emulators.kvstore.server", description=__doc__.split("\n\n")[0])
    ap.add_argument("--listen", default="127.0.0.1:0", help="host:port to listen on (port 0: pick a free one)")
    ap.add_argument("--root", required=True, help="directory holding this server's blocks")
    ap.add_argument("--capacity-bytes", type=int, required=True, help="bytes of blocks (headers included) to accept")
    ap.add_argument("--max-block-bytes", type=int, default=256 << 20)
    ap.add_argument("--max-conns", type=int, default=64)
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
        max_conns=args.max_conns,
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
