"""The scheduler core: events in, assignments out, no I/O and no clock of its own.

Events: `on_report` (an engine's load), `on_request` (a new turn), `pull(group)` (a group leader
asks for work). Time comes from an injected `clock`, so the live service passes time.monotonic and
a SimPy simulator passes `lambda: env.now`; the decisions are the same code either way.

A request moves through three queues:
  PE waiting queue --(a PE group pulls: Algorithm 1)--> DE global queue
  --(any DE group pulls: phase 1)--> that group's private queue --(its pull: phase 2 + path)-->
  complete Assignment, returned to the DE leader now and to the PE leader on its next pull.

Engines only learn of work when their leader pulls, so their reports lag the scheduler's own
assignments. Each engine and node therefore carries "inflight" amounts (assigned, not yet delivered)
that are added back onto every report; delivered work is in the engine's next report.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .de_assign import GroupBalancer, assign_de_in_group, distribute_to_groups
from .pe_assign import assign_pe
from .read_path import PathPolicy, PeOnly, RoundRobin, ShorterQueue, Split, avoid_down
from .records import (
    Assignment, EngineReport, EngineState, GroupState, NodeState, Request, Role,
)
from .thresholds import PAPER_ALPHA_S, PAPER_BETA_S, Profile, Thresholds

PATH_POLICIES = ("shorter", "rr", "split", "pe")


@dataclass(slots=True)
class _PendingPE:
    request: Request
    pe: EngineState
    at: float


class Scheduler:
    def __init__(
        self,
        profile: Profile,
        *,
        path_policy: str | PathPolicy = "shorter",
        alpha_s: float = PAPER_ALPHA_S,
        beta_s: float = PAPER_BETA_S,
        clock: Callable[[], float] = time.monotonic,
        node_snic_bytes_per_s: dict[str, float] | None = None,
        stale_after_s: float | None = None,
    ) -> None:
        """`profile` gives the profiled rates; alpha/beta are alpha_s/beta_s seconds of them.
        `node_snic_bytes_per_s` overrides the drain rate of individual nodes (split mode).
        `stale_after_s`: engines whose last report is older are not given new work (a leader
        stops reporting an engine that no longer answers), and a DE group with no such engine
        left hands its queued requests back to the other groups."""
        self.profile = profile
        self.thresholds = Thresholds.from_profile(profile, alpha_s, beta_s)
        self.clock = clock
        self.stale_after_s = stale_after_s
        self._node_bw = dict(node_snic_bytes_per_s or {})
        self.path_policy: PathPolicy = self._make_policy(path_policy)
        self.block_bytes = profile.block_tokens * profile.kv_bytes_per_token
        self.engines: dict[str, EngineState] = {}
        self.nodes: dict[str, NodeState] = {}
        self.groups: dict[str, GroupState] = {}
        self._pe_queue: deque[Request] = deque()
        self._de_global: deque[Request] = deque()
        self._de_private: dict[str, deque[Request]] = {}
        self._de_queued_tok: dict[str, int] = {}
        # phase 1's view: per DE group, engines' tok + tokens queued for it
        self._balancer = GroupBalancer()
        self._pending: dict[str, _PendingPE] = {}  # request id -> its PE, waiting for a DE
        self._outbox: dict[str, list[Assignment]] = {}  # PE group -> assignments to deliver
        self._ids: set[str] = set()  # request ids not yet delivered to their PE leader
        # groups whose own queue (PE: outbox, DE: private queue) may have changed since the
        # doorbell last looked (take_work_changes): it then reads those groups alone
        self._touched: set[str] = set()
        self._next_index = 0  # registration order: the deterministic tie-breaker

    # ----------------------------------------------------------------- configuration
    def _make_policy(self, p: str | PathPolicy) -> PathPolicy:
        if not isinstance(p, str):
            return p
        if p == "shorter":
            return ShorterQueue()
        if p == "rr":
            return RoundRobin()
        if p == "split":
            return Split(self.snic_bw)
        if p == "pe":
            return PeOnly()
        raise ValueError(f"unknown path policy {p!r}; expected one of {PATH_POLICIES}")

    def snic_bw(self, node_id: str) -> float:
        """A node's SNIC drain rate in bytes/s: its override, else the profiled rate."""
        return self._node_bw.get(node_id, self.profile.snic_bytes_per_s)

    def n_hit_blocks(self, req: Request) -> int:
        """Full Blocks holding the hit KV (a partial tail block is counted whole)."""
        return -(-req.hit_tokens // self.profile.block_tokens)

    # ----------------------------------------------------------------- events
    def on_report(self, r: EngineReport) -> None:
        """Replace an engine's (and its node's) state by a fresh report, keeping what the
        scheduler assigned that the engine cannot know about yet."""
        now = self.clock()
        e = self.engines.get(r.engine_id)
        node = self.nodes.get(r.node_id)
        if node is None:
            node = self.nodes[r.node_id] = NodeState(r.node_id)
        if e is not None and (e.group_id != r.group_id or e.role != r.role or e.node is not node):
            if e.inflight_seq:
                raise ValueError(f"engine {r.engine_id} changed group/role/node with work in flight")
            self._unregister(e)
            e = None
        if e is None:
            g = self.groups.get(r.group_id)
            if g is not None and g.role != r.role:  # checked before anything is registered
                raise ValueError(f"group {r.group_id} is {g.role.value}, engine {r.engine_id} reports {r.role.value}")
            if g is None:
                g = self.groups[r.group_id] = GroupState(r.group_id, r.role)
                self._touched.add(r.group_id)
                if r.role is Role.DECODE:
                    self._de_private[r.group_id] = deque()
                    self._de_queued_tok[r.group_id] = 0
            e = EngineState(r.engine_id, node, r.group_id, r.role, index=self._next_index)
            self._next_index += 1
            self.engines[r.engine_id] = e
            g.engines.append(e)
            if r.role is Role.DECODE:
                self._balancer.set(g.group_id, g.tok_sum + self._de_queued_tok[g.group_id])
        new_tok = r.tok_e + e.inflight_tok
        g = self.groups[e.group_id]
        if new_tok != e.tok:
            g.tok_sum += new_tok - e.tok
            e.tok = new_tok
            if g.role is Role.DECODE:
                self._balancer.set(g.group_id, g.tok_sum + self._de_queued_tok[g.group_id])
        e.seq = r.seq_e + e.inflight_seq
        e.free_hbm = r.free_hbm_tokens
        e.free_hbm_bytes = r.free_hbm_bytes
        e.last_report = now
        node.read_q = r.read_q_bytes + node.inflight_read
        node.snic_up = r.snic_up
        if g.role is Role.DECODE and g.group_id not in self._balancer.totals:  # back from the dead
            self._balancer.set(g.group_id, g.tok_sum + self._de_queued_tok[g.group_id])

    def on_reports(self, reports: Iterable[EngineReport]) -> None:
        for r in reports:
            self.on_report(r)

    def on_request(self, req: Request) -> None:
        """A new turn joins the PE waiting queue (FIFO)."""
        if req.request_id in self._ids:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        self._ids.add(req.request_id)
        self._pe_queue.append(req)

    def knows(self, request_id: str) -> bool:
        """True while a request id is in the system (submitted, not yet delivered to its PE)."""
        return request_id in self._ids

    def pull(self, group_id: str) -> list[Assignment]:
        """A group leader asks for work; returns the complete assignments for its engines."""
        g = self.groups.get(group_id)
        if g is None:
            return []
        if g.role is Role.PREFILL:
            return self._pull_pe(g)
        return self._pull_de(g)

    # ----------------------------------------------------------------- stages
    def _live(self, g: GroupState) -> list[EngineState]:
        if self.stale_after_s is None:
            return g.engines
        cutoff = self.clock() - self.stale_after_s
        return [e for e in g.engines if e.last_report >= cutoff]

    def _pull_pe(self, g: GroupState) -> list[Assignment]:
        now = self.clock()
        if self._pe_queue:
            pairs = assign_pe(self._pe_queue, self._live(g), self.thresholds)
            for req, e in pairs:
                self._pe_queue.popleft()
                e.inflight_tok += req.total_len
                e.inflight_seq += 1
                g.tok_sum += req.total_len
                self._pending[req.request_id] = _PendingPE(req, e, now)
                self._de_global.append(req)
            self._distribute()
        out = self._outbox.pop(g.group_id, [])
        if out:
            self._touched.add(g.group_id)
        for a in out:  # delivered: the PE's next report includes these
            pe = self.engines[a.pe_engine]
            pe.inflight_tok -= a.request.total_len
            pe.inflight_seq -= 1
            pe.node.inflight_read -= a.pe_blocks * self.block_bytes
            self._ids.discard(a.request_id)
        return out

    def _distribute(self) -> None:
        """Phase 1 as soon as a request has its PE: each waiting request joins one DE group's
        own queue, so the doorbell rings that group alone. Deciding at the first DE pull instead
        rang every DE group on every routed request (the shared queue's length changed), and all
        but one of them pulled nothing: at 96 DE groups, 96 pulls per request, each gathering its
        members' reports (simulator, 48P96D). The totals phase 1 reads are the same last reports
        either way. Requests wait here only while no DE group has reported."""
        if self._de_global:
            for req, gid in distribute_to_groups(self._de_global, self._balancer, self._de_private):
                self._de_queued_tok[gid] += req.total_len
                self._touched.add(gid)

    def _reclaim_dead_groups(self) -> None:
        """DE groups with no live engine leave phase 1, and what was queued for them goes back
        to the head of the global queue, in order, for the live groups to take."""
        back: list[Request] = []
        for gid, q in self._de_private.items():
            if gid in self._balancer.totals and not self._live(self.groups[gid]):
                self._balancer.remove(gid)
                back.extend(q)
                q.clear()
                self._touched.add(gid)
                self._de_queued_tok[gid] = 0
        self._de_global.extendleft(reversed(back))

    def _pull_de(self, g: GroupState) -> list[Assignment]:
        if self.stale_after_s is not None:
            self._reclaim_dead_groups()
        self._distribute()
        queue = self._de_private[g.group_id]
        if not queue:
            return []
        pairs, _z = assign_de_in_group(queue, self._live(g))
        if not pairs:
            return []
        self._touched.add(g.group_id)
        now = self.clock()
        policy = self.path_policy
        block_bytes = self.block_bytes
        out: list[Assignment] = []
        for req, de in pairs:
            queue.popleft()
            self._de_queued_tok[g.group_id] -= req.total_len
            g.tok_sum += req.total_len
            p = self._pending.pop(req.request_id)
            pe = p.pe
            d = policy.decide(self.n_hit_blocks(req), block_bytes, pe.node, de.node)
            avoided = ""
            if not getattr(policy, "single_path", False):
                d, avoided = avoid_down(d, pe.node, de.node)
            # Count the reads at once so the next decision sees them; the PE side's share is
            # inflight until the PE leader receives it, the DE side's is delivered right now.
            pe_bytes, de_bytes = d.pe_blocks * block_bytes, d.de_blocks * block_bytes
            pe.node.read_q += pe_bytes
            pe.node.inflight_read += pe_bytes
            de.node.read_q += de_bytes
            pe.node.read_total += pe_bytes
            de.node.read_total += de_bytes
            a = Assignment(
                req, pe.engine_id, pe.node.node_id, pe.group_id,
                de.engine_id, de.node.node_id, de.group_id,
                d.path, d.pe_blocks, d.de_blocks, p.at, now, avoided,
            )
            self._outbox.setdefault(pe.group_id, []).append(a)
            self._touched.add(pe.group_id)
            out.append(a)
        return out

    def cancel_waiting(self) -> list[Request]:
        """Withdraw every request that has no DE yet (e.g. at the end of a run), undoing the
        load it was counted as on its PE. Complete assignments are left to be delivered."""
        out = list(self._pe_queue)
        self._pe_queue.clear()
        for p in self._pending.values():
            e, n = p.pe, p.request.total_len
            e.tok -= n
            e.seq -= 1
            e.inflight_tok -= n
            e.inflight_seq -= 1
            self.groups[e.group_id].tok_sum -= n
            out.append(p.request)
        self._pending.clear()
        self._de_global.clear()
        for gid, q in self._de_private.items():
            if q:
                q.clear()
                self._touched.add(gid)
            if self._de_queued_tok[gid]:
                self._de_queued_tok[gid] = 0
                if gid in self._balancer.totals:
                    self._balancer.set(gid, self.groups[gid].tok_sum)
        for r in out:
            self._ids.discard(r.request_id)
        return out

    # ----------------------------------------------------------------- introspection
    @property
    def pe_waiting(self) -> int:
        """Requests waiting for a PE."""
        return len(self._pe_queue)

    def de_groups_with_work(self) -> list[str]:
        """DE groups whose private queue is non-empty: the leaders a pull would give work to."""
        return [g for g, q in self._de_private.items() if q]

    def work_for_groups(self) -> dict[str, tuple[int, int]]:
        """Per group, what is waiting for its pull: a PE group (requests waiting for a PE,
        assignments to deliver to it); a DE group (requests waiting for any DE, its own queue).
        The first is shared by every group of a role, the second is the group's own
        (own_work); the doorbell reads them apart (take_work_changes)."""
        out = {}
        pe_n, de_n = len(self._pe_queue), len(self._de_global)
        for gid, g in self.groups.items():
            out[gid] = (pe_n if g.role is Role.PREFILL else de_n, self.own_work(gid))
        return out

    def own_work(self, group_id: str) -> int:
        """A group's own waiting work: a PE group's undelivered assignments, a DE group's queue."""
        if self.groups[group_id].role is Role.PREFILL:
            return len(self._outbox.get(group_id, ()))
        return len(self._de_private.get(group_id, ()))

    def take_work_changes(self) -> tuple[int, int, set[str]]:
        """For the doorbell, its one reader: the shared queues' lengths (waiting for a PE,
        waiting for any DE) and the groups whose own work may have changed since the last call."""
        touched, self._touched = self._touched, set()
        return len(self._pe_queue), len(self._de_global), touched

    def queue_lengths(self) -> dict[str, int]:
        return {
            "pe_waiting": len(self._pe_queue),
            "de_global": len(self._de_global),
            "de_private": sum(len(q) for q in self._de_private.values()),
            "undelivered_to_pe": sum(len(v) for v in self._outbox.values()),
        }

    def _unregister(self, e: EngineState) -> None:
        g = self.groups[e.group_id]
        g.engines.remove(e)
        g.tok_sum -= e.tok
        del self.engines[e.engine_id]
        if g.role is Role.DECODE:
            if g.engines:
                self._balancer.set(g.group_id, g.tok_sum + self._de_queued_tok[g.group_id])
            else:
                self._balancer.remove(g.group_id)  # a group with no engines could never drain
