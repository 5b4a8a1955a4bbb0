"""Host agent: a node's DRAM buffer (PE or DE buffer), its store client and NIXL agent.

It runs in the node's host namespace. Engines READ from and WRITE into its
buffer one-sided; it stays passive for those (NIXL's progress thread serves
them) and only confirms, on request, that a peer's notifications have arrived.
It owns its buffer's allocator: a request's areas come from `alloc` and go back with `free`.
It serves the storage side: `load` (store -> buffer over the SNIC) on its read
queue (read_queue.py), and on its jobs socket, many at once, `flush` (buffer ->
store, for decode write-back), `wait_notifs` (until a peer's WRITEs have
landed), `alloc` and `free`. Its control socket keeps the wiring and the probes.

Faults: it watches its SNIC (the link's operational state, every SNIC_POLL_S). While the link
is down its read queue reports the SNIC down (the scheduler then reads by the other path), store
calls fail at once, and reads in progress are cut. Store reads and writes retry an unreachable
server (a crash and restart) for up to STORE_RETRY_S. A load never fails as a whole for the
store's sake: it says which blocks could not be read (missing, corrupt, unreachable), and the
conductor recomputes from the first of them; a flush says which blocks were stored.
"""
from __future__ import annotations

import math
import os
import threading
import time
from pathlib import Path

import numpy as np
from pydantic import ConfigDict, validate_call

from dualpath.nodes.common import base_args, exit_on_sigterm, make_agent, run_auth, wiring_handlers
from dualpath.nodes.common import freeze_startup_heap, jobs_port, load_port
from dualpath.nodes.leader import serve_state
from dualpath.nodes.read_queue import ReadQueueServer
from dualpath.kv.buffers import ByteAllocator, OutOfSpace
from dualpath.kv.check import stale
from dualpath.control import RouterServer, RpcServer, short
from dualpath.store.client import StoreClient
from dualpath.store.errors import StoreError
from dualpath.store.keys import check_key
from dualpath.transport.waiter import NotificationWaiter
from dualpath.timeouts import scaled

JOB_WORKERS = 64  # concurrent waits and flushes: more than the requests a node has in flight

# Timeouts a caller may ask for: a flush waits for a decode engine's WRITEs to land, a
# wait_notifs for its notifications; both hold this agent's one control socket meanwhile, so
# they are finite and at most the conductor's own call timeout (120 s) with room to spare.
MAX_TIMEOUT_S = scaled(600.0)
MAX_NOTIFS = 1 << 16  # notifications per wait_notifs (one per written-back block)
MAX_NAME_CHARS = 256  # a peer name or a notification message
STORE_RETRY_S = 30.0  # a store server that is unreachable (crashed, restarting) is retried this long
SNIC_POLL_S = 0.02  # how often the SNIC's link state is read
MAX_REPORTED_ERRORS = 8  # blocks named in a load's or flush's reply

# The storage commands' arguments are taken as sent: strict types, so "0" or true is no offset and
# [true] no CRC (pydantic's lax mode would convert them), then the checks below.
strict = validate_call(config=ConfigDict(strict=True))


def check_timeout(cmd: str, timeout_s: object, most: float = MAX_TIMEOUT_S) -> float:
    """A finite timeout in (0, most] seconds, or ValueError naming the command and field.
    NaN would never expire (every comparison with it is false) and block the control socket."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not math.isfinite(timeout_s) \
            or not 0 < timeout_s <= most:
        raise ValueError(f"{cmd}: field 'timeout_s' must be a number of seconds in (0, {most:g}], "
                         f"got {short(timeout_s)}")
    return float(timeout_s)


def check_blocks(cmd: str, keys: object, offset: object, buffer_bytes: int, block_bytes: int) -> None:
    """Keys of the store's format and consecutive slots [offset, offset + len(keys) * block)
    inside the buffer; ValueError (BadKeyError) naming the command and field otherwise."""
    if not isinstance(keys, list):
        raise ValueError(f"{cmd}: field 'keys' must be a list of block keys, got {short(keys)}")
    for i, k in enumerate(keys):
        try:
            check_key(k)
        except ValueError as e:
            raise ValueError(f"{cmd}: field 'keys' entry {i}: {e}") from None
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise ValueError(f"{cmd}: field 'offset' must be an integer, got {short(offset)}")
    end = offset + len(keys) * block_bytes
    if offset < 0 or end > buffer_bytes:
        raise ValueError(f"{cmd}: field 'offset': {len(keys)} blocks of {block_bytes} bytes at {offset} "
                         f"run outside the buffer of {buffer_bytes} bytes")


def check_flush(keys: object, offset: object, crcs: object, timeout_s: object, buffer_bytes: int,
                block_bytes: int) -> float:
    """Every argument of `flush`; returns the timeout."""
    check_blocks("flush", keys, offset, buffer_bytes, block_bytes)
    if not isinstance(crcs, list) or len(crcs) != len(keys):  # type: ignore[arg-type]
        n = len(crcs) if isinstance(crcs, list) else short(crcs)
        raise ValueError(f"flush: field 'crcs' must hold one CRC-32 per key: {n} for {len(keys)} keys")  # type: ignore[arg-type]
    for i, c in enumerate(crcs):
        if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c < 1 << 32:
            raise ValueError(f"flush: field 'crcs' entry {i} must be a CRC-32, an integer in [0, 2**32), got {short(c)}")
    return check_timeout("flush", timeout_s)


def check_wait_notifs(peer: object, msgs: object, timeout_s: object) -> float:
    """Every argument of `wait_notifs`; returns the timeout (for all the messages together)."""
    if not isinstance(peer, str) or not 0 < len(peer) <= MAX_NAME_CHARS:
        raise ValueError(f"wait_notifs: field 'peer' must be an agent name of 1..{MAX_NAME_CHARS} characters, "
                         f"got {short(peer)}")
    if not isinstance(msgs, list) or len(msgs) > MAX_NOTIFS:
        raise ValueError(f"wait_notifs: field 'msgs' must be a list of at most {MAX_NOTIFS} messages, got {short(msgs)}")
    for i, m in enumerate(msgs):
        if not isinstance(m, str) or not 0 < len(m) <= MAX_NAME_CHARS:
            raise ValueError(f"wait_notifs: field 'msgs' entry {i} must be a message of 1..{MAX_NAME_CHARS} "
                             f"characters, got {short(m)}")
    return check_timeout("wait_notifs", timeout_s)


class LinkWatch:
    """A NIC's link state, read from sysfs (this namespace's: `ip netns exec` mounts its own
    /sys) by a daemon thread; `on_down` runs once per loss of the link."""

    def __init__(self, dev: str | None, on_down=lambda: None, every_s: float = SNIC_POLL_S) -> None:
        self.dev, self.on_down, self.every_s = dev, on_down, every_s
        self._up = True
        self.downs = 0
        if dev:
            self._up = self.read()
            threading.Thread(target=self._watch, name="snic-watch", daemon=True).start()

    def read(self) -> bool:
        """Up unless the kernel says the link is down (no carrier, or administratively down)."""
        try:
            state = Path(f"/sys/class/net/{self.dev}/operstate").read_text().strip()
        except OSError:
            return False  # the device is gone
        return state in ("up", "unknown")

    def up(self) -> bool:
        return self._up

    def _watch(self) -> None:
        while True:
            now = self.read()
            if self._up and not now:
                self._up = False
                self.downs += 1
                print(f"link {self.dev} is down", flush=True)
                self.on_down()
            elif now and not self._up:
                self._up = True
                print(f"link {self.dev} is up", flush=True)
            time.sleep(self.every_s)


def store_failures(keys: list[str], e: StoreError) -> tuple[int, dict[str, str]]:
    """From a store call's error: the position of the first key that failed, and (at most
    MAX_REPORTED_ERRORS of) the failed keys with their error code and message."""
    errs = getattr(e, "errors", None) or {k: e for k in keys}
    first = min(keys.index(k) for k in errs if k in keys) if any(k in keys for k in errs) else 0
    named = {k: f"{err.code}: {short(str(err), 200)}" for k, err in list(errs.items())[:MAX_REPORTED_ERRORS]}
    return first, named


def open_store(args, buf: np.ndarray, link: LinkWatch):
    """A client of the node's store (`--store-kind`), over its SNIC."""
    if args.store_kind == "mooncake":
        from dualpath.store.mooncake import MooncakeStoreClient
        from dualpath.transport.mooncake import iface_ipv4

        return MooncakeStoreClient(args.store, args.block_bytes, iface_ipv4(args.snic), buf)
    return StoreClient(args.store.split(","), args.block_bytes, retry_s=STORE_RETRY_S, link_up=link.up,
                       link_name=f"SNIC {args.snic}")


class HostAgent:
    """A node's host agent: its DRAM buffer, the store clients that fill it and persist from it,
    and the notifications of the WRITEs into it. Its methods are the control calls it serves."""

    def __init__(self, buf, block_bytes: int, store, writes, notifs: NotificationWaiter, name: str = "host"):
        self.buf, self.view, self.fb = buf, memoryview(buf), block_bytes
        # write-back has its own client: a flush must not wait behind a long read on the same
        # connection (both share the SNIC, as two flows would)
        self.store, self.writes, self.notifs = store, writes, notifs
        self.space = ByteAllocator(len(buf), f"{name} DRAM buffer", align=64)
        self._space_lock = threading.Lock()  # alloc and free run on the jobs socket's workers
        # Names this process's areas: an area from before a restart (another epoch) went with it,
        # and freeing its offset must not free whatever now sits there.
        self.epoch = f"{os.getpid()}-{time.monotonic_ns()}"

    @strict
    def alloc(self, nbytes: int) -> dict:
        """An area of the buffer for a request: its offset and this agent's epoch, or offset
        None while the buffer has no room (the caller waits for a free and asks again)."""
        if not 0 < nbytes <= len(self.buf):
            raise ValueError(f"alloc: field 'nbytes' must be in [1, {len(self.buf)}] (the buffer's bytes), "
                             f"got {nbytes}")
        with self._space_lock:
            try:
                return {"offset": self.space.alloc(nbytes), "epoch": self.epoch}
            except OutOfSpace as e:
                return {"offset": None, "epoch": self.epoch, "error": str(e)}

    @strict
    def free(self, offset: int, epoch: str) -> dict:
        """Give an area back; one of an earlier epoch is gone already (`freed` False)."""
        if epoch != self.epoch:
            return {"freed": False}
        with self._space_lock:
            if not self.space.holds(offset):
                raise ValueError(f"free: field 'offset': no area of this buffer starts at {offset}")
            self.space.free(offset)
        return {"freed": True}

    def check_load(self, keys: list[str], offset: int) -> None:
        check_blocks("load", keys, offset, len(self.buf), self.fb)

    @strict
    def load(self, keys: list[str], offset: int) -> dict:
        """Read Full Blocks into consecutive slots of the buffer from `offset`. `failed_at`: the
        first block that could not be read (-1: none), `errors` what went wrong with which."""
        t0, fb = time.perf_counter(), self.fb
        self.check_load(keys, offset)
        r0 = self.store.retries  # loads run one at a time: the difference is this load's
        try:
            self.store.get_many(keys, self.view, [offset + i * fb for i in range(len(keys))])
            failed_at, errors = -1, {}
        except StoreError as e:
            failed_at, errors = store_failures(keys, e)
        return {"bytes": len(keys) * fb, "seconds": time.perf_counter() - t0, "failed_at": failed_at,
                "errors": errors, "retries": self.store.retries - r0}

    @strict
    def flush(self, keys: list[str], offset: int, crcs: list[int], timeout_s: float = scaled(10.0)) -> dict:
        """Persist Full Blocks from consecutive slots from `offset` (durable when this returns).

        `crcs` are the writer's checksums: a block is persisted only once what landed here
        matches (a TCP WRITE can complete before its bytes are applied; see engines/decode.py).
        """
        t0, fb, view = time.perf_counter(), self.fb, self.view
        deadline = time.monotonic() + check_flush(keys, offset, crcs, timeout_s, len(self.buf), fb)
        for i, crc in enumerate(crcs):
            while stale(view, [(offset + i * fb, fb, crc)]):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"block {keys[i]} never landed intact from the decode engine; not persisted")
                time.sleep(0.002)
        r0 = self.writes.retries  # flushes run concurrently: a retry may be another's, seen here too
        try:
            new = self.writes.put_many([(k, view[offset + i * fb: offset + (i + 1) * fb]) for i, k in enumerate(keys)])
            stored, errors = [True] * len(keys), {}
        except StoreError as e:  # e.g. the store's disk is full: the blocks are not persisted
            errs = getattr(e, "errors", None) or {k: e for k in keys}
            stored, new = [k not in errs for k in keys], []
            errors = store_failures(keys, e)[1]
        return {"bytes": len(keys) * fb, "new": sum(new), "seconds": time.perf_counter() - t0,
                "stored": stored, "errors": errors, "retries": self.writes.retries - r0}

    @strict
    def wait_notifs(self, peer: str, msgs: list[str], timeout_s: float = scaled(60.0)) -> dict:
        """Block until `peer` has notified every message: NIXL delivers a transfer's
        notification after its data, so the WRITEs before them have landed."""
        deadline = time.monotonic() + check_wait_notifs(peer, msgs, timeout_s)
        for m in msgs:  # one deadline for all: the timeout bounds the call, not each message
            self.notifs.wait(peer, m, max(0.0, deadline - time.monotonic()))
        return {}

    def contains(self, keys: list[str]) -> dict:
        return {"present": self.store.contains(keys)}

    def close(self) -> None:
        self.notifs.close()
        self.store.close()
        self.writes.close()


def _parse_args():
    ap = base_args(__doc__)
    ap.add_argument("--buffer-bytes", type=int, required=True)
    ap.add_argument("--block-bytes", type=int, required=True, help="bytes of one Full Block")
    ap.add_argument("--store", required=True, help="comma-separated host:port of the storage servers")
    ap.add_argument("--snic", default=None, help="the node's storage NIC (its link state is watched)")
    ap.add_argument("--store-kind", default="3fs-like", choices=["3fs-like", "mooncake"],
                    help="the 3FS-like store's servers, or Mooncake Store (--store: its master's ip:port)")
    return ap.parse_args()


def main() -> None:
    args = _parse_args()
    exit_on_sigterm()
    auth = run_auth()
    agent, buf = make_agent(args, "buf", args.buffer_bytes, "dram")
    clients: list = []
    link = LinkWatch(args.snic, on_down=lambda: [c.interrupt() for c in clients])
    store, writes = open_store(args, buf, link), open_store(args, buf, link)
    clients += [store, writes]
    host = HostAgent(buf, args.block_bytes, store, writes, NotificationWaiter(agent), args.name)
    # Loads queue here, on the node, where read_q can count them all; the group leaders read
    # read_q from the state socket (the control socket may be busy with a long flush).
    reads = ReadQueueServer(f"tcp://{args.ip}:{load_port(args.control_port)}", args.block_bytes, host.load,
                            host.check_load, auth=auth).start()
    serve_state(args.ip, args.control_port, {"read_q": lambda: {"bytes": reads.pending_bytes, "snic_up": link.up()}},
                auth=auth)

    def read_log() -> dict:
        """The loads read since the last call, as [start, end, bytes] (when the SNIC was busy)."""
        return {"loads": [list(x) for x in reads.drain_log()]}

    # Waits and write-backs of many requests run at once (each blocks only its own request), and
    # so do the requests' allocations, which must not queue behind them
    jobs = RouterServer(f"tcp://{args.ip}:{jobs_port(args.control_port)}",
                        {"flush": host.flush, "wait_notifs": host.wait_notifs, "alloc": host.alloc, "free": host.free},
                        workers=JOB_WORKERS, name="host-jobs",
                        auth=auth).start()
    server = RpcServer(f"tcp://{args.ip}:{args.control_port}",
                       {**wiring_handlers(agent), "contains": host.contains, "read_log": read_log}, auth=auth)
    freeze_startup_heap()
    print(f"ready {args.name} {agent.transport_in_use}", flush=True)
    try:
        server.serve()
    finally:
        jobs.stop()
        reads.stop()
        host.close()
        agent.close()


if __name__ == "__main__":
    main()
