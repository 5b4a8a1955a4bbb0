"""Engine group leaders: what each engine reports, and the leader's pull loop.

Every engine keeps an `EngineLoad` (requests it was given and has not finished)
and serves it, with its node's host agent serving the node's read queue, on a
small state socket beside its control socket. A group's leader (one of its
engines) pulls from the scheduler (dualpath.scheduler.service): each pull
carries a fresh report for every engine of the group (seq_e, tok_e, free HBM,
and the engine's node read_q), and the assignments it gets back are handed to
the engines they name. Nothing is pushed by the scheduler.
"""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Callable

import zmq
import zmq.asyncio

from dualpath.nodes.common import state_port
from dualpath.control import RpcClient, RpcServer

DEFAULT_PULL_INTERVAL_S = 0.02  # without a doorbell: pull this often while idle
HEARTBEAT_S = 0.1  # with one: pull at least this often (work deferred on load, lost rings)


class EngineLoad:
    """An engine's unfinished requests (token counts), safe to update from two threads.

    The leader may hand over an assignment after the engine already finished it (its pull
    and the conductor's command race): that request is then never counted.
    """

    def __init__(self, hbm_tokens: int) -> None:
        self.hbm_tokens = hbm_tokens
        self._lock = threading.Lock()
        self._pending: dict[str, int] = {}
        self._finished_early: set[str] = set()

    def assigned(self, request: str, tokens: int) -> None:
        with self._lock:
            if request in self._finished_early:
                self._finished_early.discard(request)
            else:
                self._pending[request] = tokens

    def finished(self, request: str) -> None:
        with self._lock:
            if self._pending.pop(request, None) is None:
                self._finished_early.add(request)

    def report(self) -> dict[str, int]:
        with self._lock:
            tok = sum(self._pending.values())
            return {"seq_e": len(self._pending), "tok_e": tok, "free_hbm_tokens": max(0, self.hbm_tokens - tok)}


def serve_state(ip: str, control_port: int, handlers: dict[str, Callable[..., dict]]) -> threading.Thread:
    """Serve `handlers` on the state socket from a daemon thread (the control socket may be
    busy for seconds with one long command)."""
    server = RpcServer(f"tcp://{ip}:{state_port(control_port)}", handlers)
    t = threading.Thread(target=server.serve, name="state", daemon=True)
    t.start()
    return t


class GroupLeader:
    """Pulls for one engine group until stopped; runs in its own thread with its own loop.

    members: engine -> (node, role, state endpoint); nodes: node -> host agent state endpoint.
    """

    def __init__(self, group: str, scheduler: str, members: dict[str, tuple[str, str, str]],
                 nodes: dict[str, str], kv_bytes_per_token: int,
                 interval_s: float = DEFAULT_PULL_INTERVAL_S, max_seconds: float = 3600.0,
                 bell: str | None = None) -> None:
        """`bell`: the scheduler's doorbell endpoint; the leader then pulls when its group's name
        rings (and every HEARTBEAT_S) instead of every interval_s."""
        self.group, self.scheduler, self.members, self.nodes = group, scheduler, members, nodes
        self.kv_bytes_per_token = kv_bytes_per_token
        self.interval_s, self.max_seconds, self.bell = interval_s, max_seconds, bell
        self.pulls = 0
        self.assigned = 0
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"leader-{group}", daemon=True)

    def start(self) -> "GroupLeader":
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> dict:
        self._stop.set()
        self._thread.join(timeout_s)
        return {"pulls": self.pulls, "assigned": self.assigned, "error": self.error}

    def _run(self) -> None:
        try:
            asyncio.run(self._loop())
        except Exception as e:  # reported to the conductor by `stop`, and printed to the log
            self.error = f"{type(e).__name__}: {e}"
            print(f"leader {self.group}: {self.error}", flush=True)

    async def _loop(self) -> None:
        from dualpath.scheduler.service import SchedulerClient

        ctx = zmq.asyncio.Context()
        sched = SchedulerClient(self.scheduler, timeout_s=10.0, context=zmq.Context())
        engines = {e: RpcClient(ctx, e, ep) for e, (_, _, ep) in self.members.items()}
        hosts = {n: RpcClient(ctx, n, ep) for n, ep in self.nodes.items()}
        bell = None
        if self.bell:
            from dualpath.scheduler.service import bell_topic

            bell = ctx.socket(zmq.SUB)
            bell.setsockopt(zmq.LINGER, 0)
            bell.setsockopt(zmq.SUBSCRIBE, bell_topic(self.group))
            bell.connect(self.bell)
        deadline = time.monotonic() + self.max_seconds
        try:
            while not self._stop.is_set() and time.monotonic() < deadline:
                reports = await self._reports(engines, hosts)
                got = await asyncio.to_thread(sched.pull, self.group, reports)
                self.pulls += 1
                for a in got:
                    mine = a.pe_engine if a.pe_group == self.group else a.de_engine
                    await engines[mine].call("assigned", request=a.request_id, tokens=a.total_len)
                self.assigned += len(got)
                if not got:  # nothing new: wait for the doorbell (or a while) before asking again
                    if bell is None:
                        await asyncio.sleep(self.interval_s)
                    else:
                        await self._wait_for_ring(bell)
        finally:
            if bell is not None:
                bell.close()
            sched.close()
            for c in (*engines.values(), *hosts.values()):
                c.close()
            ctx.term()

    async def _wait_for_ring(self, bell) -> None:
        """Until the doorbell rings, the heartbeat is due or the leader is stopped."""
        until = time.monotonic() + HEARTBEAT_S
        while not self._stop.is_set() and (left := until - time.monotonic()) > 0:
            if await bell.poll(int(min(left, 0.1) * 1000) + 1):
                while await bell.poll(0):  # one pull answers every ring so far
                    await bell.recv()
                return

    async def _reports(self, engines: dict[str, RpcClient], hosts: dict[str, RpcClient]) -> list[dict]:
        loads = await asyncio.gather(*(c.call("load", timeout_s=5.0) for c in engines.values()))
        qs = dict(zip(hosts, await asyncio.gather(*(c.call("read_q", timeout_s=5.0) for c in hosts.values()))))
        out = []
        for (engine, (node, role, _)), load in zip(self.members.items(), loads):
            out.append({"engine_id": engine, "node_id": node, "role": role, "group_id": self.group,
                        "seq_e": load["seq_e"], "tok_e": load["tok_e"], "free_hbm_tokens": load["free_hbm_tokens"],
                        "free_hbm_bytes": load["free_hbm_tokens"] * self.kv_bytes_per_token,
                        "read_q_bytes": qs[node]["bytes"]})
        return out
