"""Engine group leaders: what each engine reports, and the leader's pull loop.

Every engine keeps an `EngineLoad` (requests it was given and has not finished)
and serves it, with its node's host agent serving the node's read queue, on a
small state socket beside its control socket. A group's leader (one of its
engines) pulls from the scheduler (dualpath.scheduler.service): each pull
carries a fresh report for every engine of the group (seq_e, tok_e, free HBM,
and the engine's node read_q), and the assignments it gets back are handed to
the engines they name. Nothing is pushed by the scheduler.

Faults: a member engine that does not answer within STATE_TIMEOUT_S is left out of the
reports (the scheduler gives work only to engines reported lately) and probed in the
background until it answers again; a node whose host agent does not answer is reported with
its SNIC down (its reads go by the other path), and decode engines on it are left out too (their
KV would live in that agent's buffer). Nothing a member does can stop the leader's loop.
"""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Callable

import zmq
import zmq.asyncio

from dualpath.nodes.common import state_port
from dualpath.control import Auth, ControlError, RpcClient, RpcServer
from dualpath.timeouts import scaled

DEFAULT_PULL_INTERVAL_S = 0.02  # without a doorbell: pull this often while idle
HEARTBEAT_S = 0.1  # with one: pull at least this often (work deferred on load, lost rings)
STATE_TIMEOUT_S = scaled(3.0)  # a member's state reply (a tiny command on its own thread); 1 s made live members look dead on a loaded 2-core host
PROBE_EVERY_S = 1.0  # how often a member that stopped answering is asked again


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
        self._tok = 0  # sum of _pending's values, kept as they change (a report reads it)
        self.version = 0  # counts changes to what report() returns (a simulator reuses reports)

    def assigned(self, request: str, tokens: int) -> None:
        with self._lock:
            if request in self._finished_early:
                self._finished_early.discard(request)
            else:
                self._tok += tokens - self._pending.get(request, 0)
                self._pending[request] = tokens
                self.version += 1

    def finished(self, request: str) -> None:
        with self._lock:
            tokens = self._pending.pop(request, None)
            if tokens is None:
                self._finished_early.add(request)
            else:
                self._tok -= tokens
                self.version += 1

    def pending(self) -> dict[str, int]:
        """The requests given and not finished (token counts): empty once a mode has drained."""
        with self._lock:
            return dict(self._pending)

    def report(self) -> dict[str, int]:
        with self._lock:
            tok = self._tok
            return {"seq_e": len(self._pending), "tok_e": tok, "free_hbm_tokens": max(0, self.hbm_tokens - tok)}


def serve_state(ip: str, control_port: int, handlers: dict[str, Callable[..., dict]],
                auth: Auth | None = None) -> threading.Thread:
    """Serve `handlers` on the state socket from a daemon thread (the control socket may be
    busy for seconds with one long command)."""
    server = RpcServer(f"tcp://{ip}:{state_port(control_port)}", handlers, auth=auth)
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
                 bell: str | None = None, secret: bytes | None = None) -> None:
        """`bell`: the scheduler's doorbell endpoint; the leader then pulls when its group's name
        rings (and every HEARTBEAT_S) instead of every interval_s. `secret`: the run's, on every
        message to the scheduler and to the members' state sockets."""
        self.group, self.scheduler, self.members, self.nodes = group, scheduler, members, nodes
        self.secret = secret
        self.peers = _Peers(secret)
        self.pull_errors = 0
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

    def stop(self, timeout_s: float = scaled(5.0)) -> dict:
        self._stop.set()
        self._thread.join(timeout_s)
        return {"pulls": self.pulls, "assigned": self.assigned, "error": self.error,
                "pull_errors": self.pull_errors, "unreachable": sorted(self.peers.ever_down)}

    def _run(self) -> None:
        try:
            asyncio.run(self._loop())
        except Exception as e:  # reported to the conductor by `stop`, and printed to the log
            self.error = f"{type(e).__name__}: {e}"
            print(f"leader {self.group}: {self.error}", flush=True)

    async def _loop(self) -> None:
        from dualpath.scheduler.service import SchedulerClient

        ctx = zmq.asyncio.Context()
        sched = SchedulerClient(self.scheduler, timeout_s=scaled(10.0), context=zmq.Context(), secret=self.secret)
        peers = self.peers
        peers.open(ctx, {**{e: (ep, "load") for e, (_, _, ep) in self.members.items()},
                         **{n: (ep, "read_q") for n, ep in self.nodes.items()}})
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
                reports = await self._reports()
                try:
                    got = await asyncio.to_thread(sched.pull, self.group, reports)
                except TimeoutError:  # the scheduler is busy or gone: ask again, bounded by the deadline
                    self.pull_errors += 1
                    continue
                self.pulls += 1
                for a in got:
                    mine = a.pe_engine if a.pe_group == self.group else a.de_engine
                    await peers.ask(mine, "assigned", request=a.request_id, tokens=a.total_len)
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
            await peers.close()
            ctx.term()

    async def _wait_for_ring(self, bell) -> None:
        """Until the doorbell rings, the heartbeat is due or the leader is stopped."""
        until = time.monotonic() + HEARTBEAT_S
        while not self._stop.is_set() and (left := until - time.monotonic()) > 0:
            if await bell.poll(int(min(left, 0.1) * 1000) + 1):
                while await bell.poll(0):  # one pull answers every ring so far
                    await bell.recv()
                return

    async def _reports(self) -> list[dict]:
        """A report for every member that answers (see the module docstring for who is left out)."""
        p = self.peers
        loads = dict(zip(self.members, await asyncio.gather(*(p.ask(e, "load") for e in self.members))))
        qs = dict(zip(self.nodes, await asyncio.gather(*(p.ask(n, "read_q") for n in self.nodes))))
        return group_reports(self.group, self.members, loads, qs, self.kv_bytes_per_token)


def group_reports(group: str, members: dict[str, tuple[str, str, str]], loads: dict[str, dict | None],
                  read_qs: dict[str, dict | None], kv_bytes_per_token: int) -> list[dict]:
    """The pull's reports from what answered: `loads` per engine and `read_qs` per node, None
    where there was no answer. A silent engine is left out; a silent host agent reports its
    node's SNIC down, and leaves out the node's decode engines (their KV would land in its
    buffer). Pure: the leader's rules for faults, testable without sockets."""
    out = []
    for engine, (node, role, _) in members.items():
        load, q = loads.get(engine), read_qs.get(node)
        if load is None or (q is None and role == "decode"):
            continue
        out.append({"engine_id": engine, "node_id": node, "role": role, "group_id": group,
                    "seq_e": load["seq_e"], "tok_e": load["tok_e"], "free_hbm_tokens": load["free_hbm_tokens"],
                    "free_hbm_bytes": load["free_hbm_tokens"] * kv_bytes_per_token,
                    "read_q_bytes": q["bytes"] if q is not None else 0,
                    "snic_up": bool(q.get("snic_up", True)) if q is not None else False})
    return out


class _Peers:
    """The leader's state clients, one per member engine and node, that survive their peers:
    a call that fails or times out marks the peer down (its answer is None from then on, at
    once) and a background probe asks it again every PROBE_EVERY_S until it answers."""

    def __init__(self, secret: bytes | None) -> None:
        self.auth = Auth(secret)
        self.ever_down: set[str] = set()
        self._ctx = None
        self._eps: dict[str, tuple[str, str]] = {}  # peer -> (endpoint, the command that probes it)
        self._clients: dict[str, RpcClient] = {}
        self._probes: dict[str, asyncio.Task] = {}

    def open(self, ctx, endpoints: dict[str, tuple[str, str]]) -> None:
        self._ctx, self._eps = ctx, dict(endpoints)
        self._clients = {n: RpcClient(ctx, n, ep, auth=self.auth) for n, (ep, _) in self._eps.items()}

    def down(self) -> set[str]:
        return set(self._probes)

    async def ask(self, name: str, cmd: str, **args) -> dict | None:
        if name in self._probes or name not in self._clients:
            return None
        try:
            return await self._clients[name].call(cmd, timeout_s=STATE_TIMEOUT_S, **args)
        except ControlError as e:
            self.ever_down.add(name)
            print(f"leader: {name} stopped answering ({e}); left out until it answers", flush=True)
            self._clients.pop(name).close()
            self._probes[name] = asyncio.ensure_future(self._probe(name))
            return None

    async def _probe(self, name: str) -> None:
        endpoint, cmd = self._eps[name]
        while True:
            await asyncio.sleep(PROBE_EVERY_S)
            c = RpcClient(self._ctx, name, endpoint, auth=self.auth)
            try:
                await c.call(cmd, timeout_s=STATE_TIMEOUT_S)
            except ControlError:
                c.close()
                continue
            self._clients[name] = c
            del self._probes[name]
            return

    async def close(self) -> None:
        for t in self._probes.values():
            t.cancel()
        if self._probes:
            await asyncio.wait(list(self._probes.values()), timeout=1)
        for c in self._clients.values():
            c.close()
