"""Host agent: a node's DRAM buffer (PE or DE buffer), its store client and NIXL agent.

It runs in the node's host namespace. Engines READ from and WRITE into its
buffer one-sided; it stays passive for those (NIXL's progress thread serves
them) and only confirms, on request, that a peer's notifications have arrived.
It serves the storage side: `load` (store -> buffer over the SNIC) on its read
queue (read_queue.py), and on its jobs socket, many at once, `flush` (buffer ->
store, for decode write-back) and `wait_notifs` (until a peer's WRITEs have
landed). Its control socket keeps the short commands.
"""
from __future__ import annotations

import time
import zlib

from dualpath.agents.common import base_args, exit_on_sigterm, make_agent, wiring_handlers
from dualpath.agents.common import jobs_port, load_port
from dualpath.agents.leader import serve_state
from dualpath.agents.read_queue import ReadQueueServer
from dualpath.control import RouterServer, RpcServer
from dualpath.store.client import StoreClient
from dualpath.transport.waiter import NotificationWaiter

JOB_WORKERS = 64  # concurrent waits and flushes: more than the requests a node has in flight


def main() -> None:
    ap = base_args(__doc__)
    ap.add_argument("--buffer-bytes", type=int, required=True)
    ap.add_argument("--block-bytes", type=int, required=True, help="bytes of one Full Block")
    ap.add_argument("--store", required=True, help="comma-separated host:port of the storage servers")
    args = ap.parse_args()
    exit_on_sigterm()
    agent, buf = make_agent(args, "buf", args.buffer_bytes, "dram")
    store = StoreClient(args.store.split(","), args.block_bytes)
    # write-back gets its own connections: a flush must not wait behind a long read on the same
    # socket (both share the SNIC, as two flows would)
    writes = StoreClient(args.store.split(","), args.block_bytes)
    notifs = NotificationWaiter(agent)
    view = memoryview(buf)
    fb = args.block_bytes

    def load(keys: list[str], offset: int) -> dict:
        """Read Full Blocks into consecutive slots of the buffer from `offset`."""
        t0 = time.perf_counter()
        if offset < 0 or offset + len(keys) * fb > len(buf):
            raise ValueError(f"load of {len(keys)} blocks at {offset} runs past the buffer")
        store.get_many(keys, view, [offset + i * fb for i in range(len(keys))])
        return {"bytes": len(keys) * fb, "seconds": time.perf_counter() - t0}

    def flush(keys: list[str], offset: int, crcs: list[int], timeout_s: float = 10.0) -> dict:
        """Persist Full Blocks from consecutive slots from `offset` (durable when this returns).

        `crcs` are the writer's checksums: a block is persisted only once what landed here
        matches (a TCP WRITE can complete before its bytes are applied; see engines/decode.py).
        """
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout_s
        for i, crc in enumerate(crcs):
            while zlib.crc32(view[offset + i * fb: offset + (i + 1) * fb]) != crc:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"block {keys[i]} never landed intact from the decode engine; not persisted")
                time.sleep(0.002)
        new = writes.put_many([(k, view[offset + i * fb: offset + (i + 1) * fb]) for i, k in enumerate(keys)])
        return {"bytes": len(keys) * fb, "new": sum(new), "seconds": time.perf_counter() - t0}

    def wait_notifs(peer: str, msgs: list[str], timeout_s: float = 60.0) -> dict:
        """Block until `peer` has notified every message: NIXL delivers a transfer's
        notification after its data, so the WRITEs before them have landed."""
        for m in msgs:
            notifs.wait(peer, m, timeout_s)
        return {}

    def contains(keys: list[str]) -> dict:
        return {"present": store.contains(keys)}

    # Loads queue here, on the node, where read_q can count them all; the group leaders read
    # read_q from the state socket (the control socket may be busy with a long flush).
    reads = ReadQueueServer(f"tcp://{args.ip}:{load_port(args.control_port)}", fb, load).start()
    serve_state(args.ip, args.control_port, {"read_q": lambda: {"bytes": reads.pending_bytes}})

    def read_log() -> dict:
        """The loads read since the last call, as [start, end, bytes] (when the SNIC was busy)."""
        return {"loads": [list(x) for x in reads.drain_log()]}

    # Waits and write-backs of many requests run at once (each blocks only its own request)
    jobs = RouterServer(f"tcp://{args.ip}:{jobs_port(args.control_port)}",
                        {"flush": flush, "wait_notifs": wait_notifs}, workers=JOB_WORKERS, name="host-jobs").start()
    server = RpcServer(f"tcp://{args.ip}:{args.control_port}",
                       {**wiring_handlers(agent), "contains": contains, "read_log": read_log})
    print(f"ready {args.name} {agent.transport_in_use}", flush=True)
    try:
        server.serve()
    finally:
        jobs.stop()
        reads.stop()
        notifs.close()
        store.close()
        writes.close()
        agent.close()


if __name__ == "__main__":
    main()
