"""The live scheduler: the ZeroMQ service on the conductor's address, pulled by engine group leaders.

`ServiceRouter` is the conductor's side. It runs the service (dualpath.scheduler.service) in a
thread on the compute bridge, submits each request to it as a frontend would, and learns the
decision when a DE group leader's pull produced it, then that the PE's leader has pulled it too:
only then may the PE be given the request's prefill. It makes no decision itself.

Groups: the prefill engines form one group (one data-parallel attention group, whose forward
passes the compute quota keeps even); each decode node's engines form one group, so DE phase 1
balances across nodes. A group's first engine leads it.

Faults: a leader skips members that stop answering (dualpath/nodes/leader.py) and the scheduler
gives no work to engines not reported within STALE_AFTER_S. When a leader's process exits, the
group's next live engine is made its leader (within WATCH_EVERY_S): the group goes on with the
engines it has left. A group with no live engine is dead; a request fails at once only when
every group of a role is dead.
"""
from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from dualpath.control import ControlError
from dualpath.nodes.common import state_port
from dualpath.scheduler.core import Scheduler
from dualpath.scheduler.messages import RequestMsg
from dualpath.scheduler.records import Assignment, Request
from dualpath.scheduler.service import SchedulerClient, SchedulerService
from testbed.cluster.processes import CONTROL_PORT, Cluster
from testbed.fabric.network import engine_groups
from dualpath.kv.plan import Route

SERVICE_MAX_S = 6 * 3600  # the serving loop's own bound; a run stops it long before
STALE_AFTER_S = 2.0  # testbed seconds without a report: the scheduler offers an engine no new work
WATCH_EVERY_S = 0.2  # how often the leaders' processes are checked


def groups_of(cluster: Cluster) -> dict[str, list[str]]:
    """Group id -> its engines, leader first (testbed.fabric.network.engine_groups)."""
    return {g: [e.name for e in eps if e.name in cluster.procs]
            for g, eps in engine_groups(cluster.fab.endpoints).items()}


def next_leaders(engines: list[str], dead: str, alive) -> list[str]:
    """Who may lead a group after `dead`: its live engines, in the group's order after it (then
    the ones before), so a leadership moves one way and every engine's turn comes."""
    i = engines.index(dead)
    return [e for e in engines[i + 1:] + engines[:i] if alive(e)]


class Router(Protocol):
    """What the conductor asks of whoever decides: engines and a read path for a request."""

    async def route(self, req: Request, timeout_s: float) -> Route:
        """TimeoutError if no engine admitted the request within timeout_s; ControlError if none
        can (every group of a role lost its leader)."""

    async def release(self, request_id: str, *engines: str) -> None:
        """The request will not run on these engines: they stop counting it."""


def stalled(now: float, started: float, last_admitted: float, timeout_s: float) -> bool:
    """A request's wait is a stall once timeout_s passed since it was submitted and since any
    request was last admitted: a queue that moves is not a hang, however long it is."""
    return now - max(started, last_admitted) >= timeout_s


def why_waiting(sched: Scheduler, req: Request) -> str:
    """What the scheduler saw when a request timed out: each engine's tokens, free HBM tokens
    and report age, and the queues (read from another thread: a snapshot for the error only)."""
    try:
        now = sched.clock()
        engines = ", ".join(f"{e.engine_id} tok {e.tok} free {e.free_hbm} ({now - e.last_report:.1f} s ago)"
                            for e in list(sched.engines.values()))
        return (f"the request needs {req.total_len} tokens; queues {sched.queue_lengths()}; a PE admits "
                f"under {sched.thresholds.beta_tokens:.0f} tokens; engines: {engines}")
    except Exception as e:  # a snapshot taken mid-update: say so rather than hide the timeout
        return f"(no scheduler snapshot: {type(e).__name__}: {e})"


class ServiceRouter:
    def __init__(self, cluster: Cluster, scheduler: Scheduler, bind_ip: str,
                 interval_s: float = 0.02) -> None:
        self.c, self.interval_s = cluster, interval_s
        self.loop = cluster.loop
        self.groups = groups_of(cluster)
        self.leaders = {g: e[0] for g, e in self.groups.items()}  # the current leader of each group
        self.failovers: list[dict] = []
        self._dead_groups: dict[str, str] = {}
        self._watch: asyncio.Task | None = None
        self._roles = {g: ("prefill" if g == "pe" else "decode") for g in self.groups}
        self._decided: dict[str, asyncio.Future] = {}
        self._delivered: dict[str, asyncio.Future] = {}
        self.service = SchedulerService(scheduler, f"tcp://{bind_ip}:*", on_pull=self._on_pull,
                                        secret=cluster.auth.secret)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self.service.serve, args=(10 ** 9, SERVICE_MAX_S, self._stop),
                                        name="scheduler", daemon=True)
        self._frontend = ThreadPoolExecutor(1, thread_name_prefix="frontend")  # owns the client socket
        self._client: SchedulerClient | None = None
        self.leader_stats: dict[str, dict] = {}
        self.load_left: dict[str, dict] = {}  # engine -> requests it still counted when the mode ended
        self._abandoned: set[str] = set()  # timed out here, perhaps still queued in the scheduler
        self._last_admitted = time.monotonic()  # when a pull last assigned anything

    # -- lifecycle (on the cluster's loop) -------------------------------------------------------
    async def start(self) -> None:
        self._thread.start()
        self._client = await self.loop.run_in_executor(
            self._frontend, lambda: SchedulerClient(self.service.endpoint, secret=self.c.auth.secret))
        for group in self.groups:
            await self._lead(group, self.leaders[group])
        self._watch = asyncio.ensure_future(self._watchdog())

    async def _lead(self, group: str, leader: str) -> None:
        """Make `leader` pull for `group`, with the group's members that are still alive."""
        engines = [e for e in self.groups[group] if self.c.procs[e].alive()]
        members = {e: [self.c.host_of(e), self._roles[group], self._state(e)] for e in engines}
        nodes = {self.c.host_of(e): self._state(self.c.host_of(e)) for e in engines}
        await self.c.clients[leader].call("lead", group=group, scheduler=self.service.endpoint,
                                          members=members, nodes=nodes, interval_s=self.interval_s,
                                          bell=self.service.bell_endpoint, timeout_s=30)

    async def _watchdog(self) -> None:
        """A group whose leader's process exited gets its next live engine as leader."""
        while True:
            await asyncio.sleep(WATCH_EVERY_S)
            for group, leader in list(self.leaders.items()):
                if self.c.procs[leader].alive():
                    continue
                t0 = time.monotonic()
                for e in next_leaders(self.groups[group], leader, lambda n: self.c.procs[n].alive()):
                    try:
                        await self._lead(group, e)
                    except ControlError:
                        continue
                    self.leaders[group] = e
                    self.failovers.append({"group": group, "from": leader, "to": e, "t": t0,
                                           "took_s": round(time.monotonic() - t0, 3)})
                    break
                else:
                    self.failovers.append({"group": group, "from": leader, "to": None, "t": t0})
                    self.leaders.pop(group)  # no live engine left: the group is dead
                    self._dead_groups[group] = leader

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
        for group in self.groups:
            leader = self.leaders.get(group)
            if leader is None or not self.c.procs[leader].alive():
                self.leader_stats[group] = {"error": f"no live leader (last {self._dead_groups.get(group, leader)})"}
                continue
            try:
                self.leader_stats[group] = await self.c.clients[leader].call("unlead", timeout_s=10)
            except Exception as e:  # a dead leader must not stop the others from being stopped
                self.leader_stats[group] = {"error": str(e)}
        await self._check_drained()
        self._stop.set()
        self._thread.join(5)
        if self._client is not None:
            await self.loop.run_in_executor(self._frontend, self._client.close)
        self._frontend.shutdown()
        self.service.close()

    async def _check_drained(self) -> None:
        """Every engine's load must be empty once its mode has drained: a request it still counts
        would hold its tokens (and the decode HBM they stand for) against the next mode."""
        for e in (e for g in self.groups.values() for e in g if self.c.procs[e].alive()):
            try:
                left = (await self.c.clients[e].call("load_pending", timeout_s=5)).get("pending") or {}
            except Exception as err:  # reported, not raised: the mode's own results stand
                left = {"(not asked)": str(err)}
            if left:
                self.load_left[e] = left

    def stats(self) -> dict:
        return {"service": self.service.endpoint, "messages": self.service.handled, "errors": self.service.errors,
                "load_left": self.load_left,
                "refused": self.service.auth.refused, "failovers": self.failovers,
                "groups": {g: {"leader": self.leaders.get(g), "engines": e, **self.leader_stats.get(g, {})}
                           for g, e in self.groups.items()}}

    def _state(self, proc: str) -> str:
        return f"tcp://{self.c.procs[proc].endpoint.ip}:{state_port(CONTROL_PORT)}"

    # -- the frontend ----------------------------------------------------------------------------
    def _on_pull(self, group: str, assignments: list[Assignment]) -> None:
        """From the service thread: a DE leader's pull decided, a PE leader's pull delivered."""
        waiting = self._delivered if self._roles[group] == "prefill" else self._decided
        self.loop.call_soon_threadsafe(self._resolve, waiting, assignments)

    def _resolve(self, waiting: dict[str, asyncio.Future], assignments: list[Assignment]) -> None:
        if assignments:
            self._last_admitted = time.monotonic()
        for a in assignments:
            fut = waiting.pop(a.request_id, None)
            if fut is not None and not fut.done():
                fut.set_result(a)
            elif a.request_id in self._abandoned:  # its engines' leaders count it: release it there
                engine = a.de_engine if waiting is self._decided else a.pe_engine
                if waiting is self._delivered:
                    self._abandoned.discard(a.request_id)  # delivered to its PE: the last the scheduler says of it
                asyncio.ensure_future(self.release(a.request_id, engine))

    async def route(self, req: Request, timeout_s: float) -> Route:
        decided, delivered = self.loop.create_future(), self.loop.create_future()
        self._decided[req.request_id] = decided
        self._delivered[req.request_id] = delivered
        msg = RequestMsg(request_id=req.request_id, hit_tokens=req.hit_tokens, miss_tokens=req.miss_tokens,
                         total_len=req.total_len)
        await self.loop.run_in_executor(self._frontend, self._client.submit, [msg])
        started = time.monotonic()
        try:
            a = await self._until(decided, started, timeout_s)
            await self._until(delivered, started, timeout_s)
        except asyncio.TimeoutError:
            self._abandon(req.request_id)
            raise asyncio.TimeoutError(f"no engine admitted the request, and none any other, for {timeout_s:g} s "
                                       f"({'decided, not delivered to its PE' if decided.done() else 'not decided'}); "
                                       + why_waiting(self.service.scheduler, req)) from None
        except ControlError:
            self._abandon(req.request_id)
            raise
        return Route(a.pe_engine, a.de_engine, a.path.value, a.pe_blocks, a.avoided)

    def _abandon(self, request_id: str) -> None:
        """The conductor stopped waiting: the scheduler may still assign the request later, and
        whatever engine it then names must not count it for ever (_resolve releases it)."""
        self._decided.pop(request_id, None)
        self._delivered.pop(request_id, None)
        self._abandoned.add(request_id)

    async def release(self, request_id: str, *engines: str) -> None:
        """Tell engines that a request they were given will not run (it failed, or was abandoned):
        each drops it from the load it reports, so its tokens stop holding their HBM."""
        for e in dict.fromkeys(engines):
            if e in self.c.procs and self.c.procs[e].alive():
                try:
                    await self.c.clients[e].call("load_done", request=request_id, timeout_s=5)
                except Exception:  # a dead or stuck engine: its load no longer matters or heals on restart
                    pass

    async def _until(self, fut: asyncio.Future, started: float, timeout_s: float):
        """The decision, or an error as soon as no live group of a role is left to pull for it
        (a group pulls only through its leader), or TimeoutError once neither this request nor any
        other was admitted for timeout_s (a request that queues behind admitted ones waits on)."""
        while True:
            try:
                return await asyncio.wait_for(asyncio.shield(fut), 0.5)
            except asyncio.TimeoutError:
                if stalled(time.monotonic(), started, self._last_admitted, timeout_s):
                    raise
            for role in ("prefill", "decode"):
                groups = [g for g, r in self._roles.items() if r == role]
                dead = [g for g in groups if not any(self.c.procs[e].alive() for e in self.groups[g])]
                if dead and len(dead) == len(groups):
                    raise ControlError(f"no {role} group can pull for the request: every engine of "
                                       + ", ".join(f"group {g} ({', '.join(self.groups[g])})" for g in dead)
                                       + " exited")
