"""The simulator: a DualPath cluster as SimPy processes around the scheduler core, unchanged.

What runs is the testbed's own code where the testbed has it:
  * `dualpath.scheduler.core.Scheduler` decides (on_request, on_report, pull), driven by the
    group leaders' loop of dualpath/nodes/leader.py (report every member, pull, hand the
    assignments on, wait for the doorbell or the heartbeat) and the service's doorbell rule
    (dualpath.scheduler.service.Doorbell); engines keep `dualpath.nodes.leader.EngineLoad`;
  * the request lifecycle (dualpath.lifecycle), the testbed conductor's own: route, buffer areas,
    loads, prefill, the layers' notifications, decode, write-back, what the store then holds; its
    steps take simulated time in steps.py;
  * the PEs' passes are packed by the lifecycle's PrefillBatcher under the compute quota, chunking
    as on the testbed; their windows come from the target's cost model;
  * decode engines batch every ready request (dualpath/engines/decode.py) and a step lasts the
    target's `DecodeCostModel.step_cost` of its batch;
  * every byte moves as a flow over the hops of `dualpath.accounting` (PE and DE path, split,
    chunk re-reads, write-back) on the max-min link model of flows.py (network.py), a storage
    NIC per node fed by the node's FIFO read queue (dualpath/nodes/read_queue.py), a server per
    storage host with its NIC and disk; in a testbed configuration every shaped NIC keeps the
    HTB bucket emulators/nic.py gives it, so a flow whose links all hold tokens sends its first
    bytes at once (up to a bucket: 64 KiB and an MTU, or 1 ms of the link) and the rest at the
    link's rate (a link refills while idle, stays full while its flows leave it capacity to
    spare, and has none while they fill it); an exposed pass's per-layer READs each find the
    bucket refilled by the window before them.
What it models: time. A prefill pass computes layer by layer: layer l + 1's KV is READ while layer
l computes (layerwise; basic reads every layer first), so a pass whose reads take L * d lasts
min(d, w) + L * max(d, w) for windows of w; every layer's KV is written toward the DE buffer as it
is computed. A decode engine's steps between two changes of its batch are summed in closed form
(a step's cost is linear in its contexts, which grow by one per step), so an engine costs events
per request, not per token. The testbed's own latencies (control round trips, fixed costs of a
pass, a step, a load, a flush) come from a Calibration fitted on a testbed run.

Time is the simulated cluster's: testbed seconds for a testbed configuration (the emulated
seconds times the dilation, as a testbed run keeps them), or the target's seconds (dilation 1).
Nothing here imports the testbed; `testbed.sim.drive` builds a SimConfig from a topology.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import simpy

from dualpath.lifecycle.index import StoreIndex
from dualpath.lifecycle.prefill import PrefillBatcher, PrefillJob
from dualpath.lifecycle.request import RequestLifecycle
from dualpath.nodes.leader import HEARTBEAT_S
from dualpath.scheduler.core import Scheduler
from dualpath.scheduler.cost_model import AttentionCostModel, DecodeCostModel
from dualpath.scheduler.hbm import HbmPlan
from dualpath.scheduler.records import EngineReport, Request, Role
from dualpath.scheduler.service import Doorbell
from dualpath.scheduler.thresholds import Profile
from dualpath.lifecycle.record import RequestRecord
from .calibration import Calibration
from .flows import Link
from .network import SimNetwork
from simulator.agents import TrajectorySpec
from simulator.parts import _Bell, _DecodeEngine, _DecodeJob, _Engine, _Host, _HostCpu, _Jitter
from simulator.steps import LifecycleSteps


@dataclass(frozen=True)
class SimConfig:
    """One cluster and its time base. Rates are payload bit/s; times are the simulation's seconds
    (testbed seconds when `dilation` is a testbed run's, the target's own when it is 1)."""

    prefill_nodes: int
    decode_nodes: int
    engines_per_node: int
    cnic_bps: float
    snic_bps: float
    host_port_bps: float
    storage_servers: int
    storage_nic_bps: float
    disk_bps: float
    qos: bool
    kv_bytes_per_token: int  # of the simulated KV (the testbed model's, or the target's)
    n_layer: int
    block_size: int
    dilation: float  # simulation seconds per emulated (target) second
    prefill_cost: AttentionCostModel  # the target's, emulated seconds
    decode_cost: DecodeCostModel
    profile: Profile  # what the scheduler is told (rates per simulation second)
    alpha_s: float  # the scheduler's alpha and beta, as testbed.experiments.ablation._router passes them
    beta_s: float
    quota_s: float  # the compute quota, emulated seconds
    hbm_tokens: int  # KV tokens per decode engine's HBM
    buffer_bytes: int  # DRAM buffer per node
    calibration: Calibration = field(default_factory=Calibration)
    pe_groups: str = "one"  # "one": every PE in one group (the testbed's); "node": a group per node
    node_prefix: str = "dpt-"
    # HTB's token bucket per shaped NIC kind (snic, cnic, host_port, storage_nic), payload bytes:
    # an idle link's first bytes leave at line rate. Empty: no buckets (the target's own NICs).
    buckets: dict[str, float] = field(default_factory=dict)
    seed: int = 0  # draws the calibration's latency jitter (none when it is 0)
    hbm: HbmPlan | None = None  # the target's HBM per engine: prefill passes are packed against it

    @property
    def full_block_bytes(self) -> int:
        return self.block_size * self.kv_bytes_per_token

    def blocks_spanned(self, n_tokens: int) -> int:  # what plan_request asks of a geometry
        return -(-n_tokens // self.block_size)


@dataclass
class SimResult:
    mode: str
    records: list[RequestRecord]
    t0: float
    jct_s: float  # simulation seconds: last request done - start
    passes: list[dict]
    decode_segments: int
    decode_steps: int
    decode_step_tokens: int
    link_bytes: dict[str, float]  # "node/kind/dir" -> bytes delivered
    scheduler: dict[str, Any]
    agent_jct_s: list[float]
    events: int
    wall_s: float
    network: dict[str, Any]


class ClusterSim(LifecycleSteps):
    """One mode of one cluster over one workload; `run()` returns a SimResult."""

    def __init__(self, cfg: SimConfig, mode: str, connector: str, path_policy: str,
                 trajectories: Sequence[TrajectorySpec], cal: Calibration | None = None,
                 warm_keys: Sequence[tuple[int, ...]] = ()):
        self.cfg, self.mode, self.connector = cfg, mode, connector
        self.cal = cal or cfg.calibration
        self.env = simpy.Environment()
        self.net = SimNetwork(self.env)
        self.cpu = _HostCpu(self.cal)
        self._jitter = _Jitter(self.cal.jitter, f"{cfg.seed}:{mode}")
        self.trajectories = trajectories
        self.sched = Scheduler(cfg.profile, path_policy=path_policy, alpha_s=cfg.alpha_s, beta_s=cfg.beta_s,
                               clock=lambda: self.env.now)
        self.sched_s = 0.0  # wall seconds inside the scheduler (its decision cost)
        self.sched_calls = 0
        self._bucket: dict[Link, float] = {}  # a shaped link's HTB bucket, payload bytes
        self._tokens: dict[Link, tuple[float, float]] = {}  # (tokens, since) of an idle bucketed link
        p = cfg.node_prefix
        self.hosts: dict[str, _Host] = {}
        self.engines: dict[str, _Engine] = {}
        self.groups: dict[str, list[_Engine]] = {}
        for role, n_nodes, tag in ((Role.PREFILL, cfg.prefill_nodes, "p"), (Role.DECODE, cfg.decode_nodes, "d")):
            for i in range(n_nodes):
                node = f"{p}{tag}{i}"
                h = self.hosts[node] = _Host(self, node)
                group = ("pe" if cfg.pe_groups == "one" else f"pe-{node}") if role is Role.PREFILL else f"de-{node}"
                for e in range(cfg.engines_per_node):
                    eng = _Engine(self, f"{node}e{e}", h, role, group)
                    self.engines[eng.name] = eng
                    self.groups.setdefault(group, []).append(eng)
        self.decoders = {n: _DecodeEngine(self, e) for n, e in self.engines.items() if e.role is Role.DECODE}
        self.storage = [(self.shaped(Link(f"storage{s}/nic/tx", cfg.storage_nic_bps, qos=False), "storage_nic"),
                         self.shaped(Link(f"storage{s}/nic/rx", cfg.storage_nic_bps, qos=False), "storage_nic"),
                         Link(f"storage{s}/disk", cfg.disk_bps, qos=False)) for s in range(cfg.storage_servers)]
        # Storage links that can never be full are left out of the flows (exactly: max-min rates
        # do not change): all servers' NICs (or disks) together at least every SNIC together.
        n_nodes = cfg.prefill_nodes + cfg.decode_nodes
        self._storage_nic_binds = cfg.storage_nic_bps * cfg.storage_servers < n_nodes * cfg.snic_bps
        self._disk_binds = cfg.disk_bps * cfg.storage_servers < 2 * n_nodes * cfg.snic_bps
        self.bells = {g: _Bell() for g in self.groups}
        self._doorbell = Doorbell(self.sched)
        self._decided: dict[str, simpy.Event] = {}
        self._delivered: dict[str, simpy.Event] = {}
        # Trace agents share one store, keyed by block: what the warm-up persisted before the mode's
        # first request, then what every request's write-back (or the oracle) persists.
        self.index = StoreIndex(k for ks in warm_keys for k in ks)
        self.batcher = PrefillBatcher(cfg.prefill_cost, cfg.quota_s, cfg.kv_bytes_per_token, lambda: self.env.now,
                                      cfg.hbm.prefill(connector) if cfg.hbm else None)
        self.lifecycle = RequestLifecycle(cfg, connector, self.index, lambda e: self.engines[e].node.name,
                                          lambda: self.env.now, hbm=cfg.hbm)
        self.records: list[RequestRecord] = []
        self.t0 = 0.0

    # ------------------------------------------------------------------ the scheduler service
    def _service(self, fn, *args):
        t = time.perf_counter()
        out = fn(*args)
        self.sched_s += time.perf_counter() - t
        self.sched_calls += 1
        return out

    def _ring(self) -> None:
        t = time.perf_counter()
        groups = self._doorbell.groups_to_ring()
        self.sched_s += time.perf_counter() - t
        for g in groups:
            b = self.bells[g]
            b.rung = True
            if b.event is not None and not b.event.triggered:
                b.event.succeed()

    def _report(self, e: _Engine) -> EngineReport:
        """The engine's report, the one it sent last while neither its load nor its node's read
        queue has changed since (a leader of 384 PEs reports every one on each pull)."""
        key = (e.load.version, e.node.read_q)
        if e.last_report is not None and e.last_report[0] == key:
            return e.last_report[1]
        r = e.load.report()
        kvb = self.cfg.kv_bytes_per_token
        rep = EngineReport(e.name, e.node.name, e.role, e.group, r["seq_e"], r["tok_e"],
                           r["free_hbm_tokens"], r["free_hbm_tokens"] * kvb, e.node.read_q)
        e.last_report = (key, rep)
        return rep

    def _leader(self, group: str):
        """dualpath/nodes/leader.py GroupLeader._loop, in simulated time."""
        env, rpc = self.env, self.cal.rpc_s
        members = self.groups[group]
        bell = self.bells[group]
        heartbeat = HEARTBEAT_S  # the control plane keeps real seconds (see calibration.py)
        registered = self._registered[group]
        while True:
            yield self._lat(rpc)  # every member's load and its node's read_q, gathered at once
            reports = [self._report(e) for e in members]
            yield self._lat(rpc / 2)  # the pull reaches the service

            def pull():
                for r in reports:
                    self.sched.on_report(r)
                return self.sched.pull(group)

            got = self._service(pull)
            if not registered.triggered:
                registered.succeed()
            if got:
                waiting = self._delivered if members[0].role is Role.PREFILL else self._decided
                for a in got:
                    ev = waiting.pop(a.request_id, None)
                    if ev is not None:
                        ev.succeed(a)
            self._ring()
            yield self._lat(rpc / 2)  # the reply
            for a in got:
                yield self._lat(rpc)  # "assigned" to the engine it names
                mine = a.pe_engine if a.pe_group == group else a.de_engine
                self.engines[mine].load.assigned(a.request_id, a.request.total_len)
            if not got:
                if not bell.rung:
                    bell.event = env.event()
                    yield bell.event | env.timeout(heartbeat)
                    bell.event = None
                bell.rung = False

    # ------------------------------------------------------------------ network helpers
    def _lat(self, seconds: float):
        """A latency of the testbed's software, stretched by its host's CPU load now, and varying
        from one message to the next as the calibration's jitter says."""
        return self.env.timeout(seconds * self._jitter.factor() * self.cpu.factor(self.env.now))

    def shaped(self, link: Link, kind: str) -> Link:
        """`link`, with the HTB bucket of its NIC kind when the config has one, and what a fresh
        flow sends beyond it (the calibration's burst_extra_bytes)."""
        b = self.cfg.buckets.get(kind, 0.0)
        if b > 0:
            b += self.cal.burst_extra_bytes.get(kind, 0.0)
            self._bucket[link] = b
            self._tokens[link] = (b, 0.0)  # full: idle since before the run
        return link

    def _flow(self, path, nbytes, layers: tuple[int, float] | None = None):
        """A transfer over `path`. `layers` = (L, w): it stands for an exposed pass's L per-layer
        READs, each issued after the window (w) before it, so each finds its links' buckets
        refilled by that window while they carry nothing else."""
        self.cpu.add(self.env.now, nbytes=2 * nbytes)  # a hop: its source NIC sends, its destination receives
        if not self._bucket:
            return self.net.transfer(path, nbytes)
        if layers is None:
            rest = nbytes - self._burst(path, nbytes)
        else:
            n_layers, window = layers
            per_layer = nbytes / n_layers
            first = self._burst(path, per_layer)
            refill = min((min(self._bucket[l], window * l.capacity_bps / 8) for l in path if l in self._bucket),
                         default=0.0) if first > 0 else 0.0
            rest = nbytes - first - (n_layers - 1) * min(per_layer, refill)
        if rest < nbytes:  # the burst crossed every link of the path at once: count it there
            d = self.net.net.delivered
            for l in path:
                d[l] = d.get(l, 0.0) + (nbytes - rest)
        ev = self.net.transfer(path, rest)
        if rest > 0:
            ev.callbacks.append(lambda done: self._idle(done.value))
        return ev

    def _burst(self, path, nbytes: float) -> float:
        """HTB's burst: bytes of a new flow that leave at once, as many as every shaped link on its
        path holds tokens for. A link gains tokens at its rate and spends them on what it sends, up
        to its bucket: an idle one refills from when it went idle, one whose flows leave it capacity
        to spare keeps its bucket full, and one its flows fill has none to spare."""
        now, busy = self.env.now, self.net.net.flows_on
        shaped = [l for l in path if l in self._bucket]
        if not shaped:
            return 0.0
        have = {}
        for l in shaped:
            if busy(l):
                if self.net.saturated(l):
                    return 0.0
                have[l] = self._bucket[l]
            else:
                tok, since = self._tokens[l]
                have[l] = min(self._bucket[l], tok + (now - since) * l.capacity_bps / 8)
        free = min(nbytes, *have.values())
        for l, h in have.items():
            if not busy(l):
                self._tokens[l] = (h - free, now)
        return free

    def _idle(self, flow) -> None:
        """`flow` ended: a shaped link it leaves empty starts refilling, from empty if the flow
        could fill it (it was sending at its rate), else from a full bucket."""
        for l, bound in zip(flow.path, flow.ubs):
            if l in self._bucket and not self.net.net.flows_on(l):
                spare = bound < l.capacity_bps * (1 - 1e-9)
                self._tokens[l] = (self._bucket[l] if spare else 0.0, self.env.now)

    def _storage_paths(self, node_link: Link, read: bool) -> list[tuple[list[Link], float]]:
        """A load's (or flush's) flows: one per storage server when the storage side can bind
        (blocks are striped over the servers), else one over the node's SNIC alone."""
        if not (self._storage_nic_binds or self._disk_binds):
            return [([node_link], 1.0)]
        share = 1.0 / len(self.storage)
        out = []
        for tx, rx, disk in self.storage:
            path = [node_link]
            if self._storage_nic_binds:
                path.append(tx if read else rx)
            if self._disk_binds:
                path.append(disk)
            out.append((path, share))
        return out

    # ------------------------------------------------------------------ host agents
    def _load(self, host: _Host, nbytes: int, done: simpy.Event) -> None:
        """A load accepted by the node's read queue (counted in read_q at once)."""
        host.read_q += nbytes
        host.loads.append((nbytes, done))
        if host.worker_idle is not None and not host.worker_idle.triggered:
            host.worker_idle.succeed()

    def _read_worker(self, host: _Host):
        env = self.env
        while True:
            if not host.loads:
                host.worker_idle = env.event()
                yield host.worker_idle
                host.worker_idle = None
                continue
            nbytes, done = host.loads.popleft()
            if self.cal.load_fixed_s:
                yield self._lat(self.cal.load_fixed_s)
            flows = [self._flow(path, nbytes * share) for path, share in self._storage_paths(host.snic_rx, True)]
            yield simpy.AllOf(env, flows)
            host.read_q -= nbytes
            done.succeed()

    def _flush(self, host: _Host, nbytes: int):
        env = self.env
        if self.cal.flush_fixed_s:
            yield self._lat(self.cal.flush_fixed_s)
        if self.cal.read_contention_s and (host.read_q > 0):
            yield self._lat(self.cal.read_contention_s)
        flows = [self._flow(path, nbytes * share) for path, share in self._storage_paths(host.snic_tx, False)]
        yield simpy.AllOf(env, flows)

    def _pass(self, pe: _Engine, jobs: list[PrefillJob], batch):
        """One forward pass on the engine (dualpath/engines/prefill.py), in simulated time."""
        env, cfg, cal = self.env, self.cfg, self.cal
        kvb, L = cfg.kv_bytes_per_token, cfg.n_layer
        a, b, c = cal.pass_cpu  # the testbed model's own compute for this pass (host CPU)
        self.cpu.add(env.now, compute_s=a + b * len(jobs) + c * batch.predicted_s)
        if cal.pass_fixed_s:
            yield self._lat(cal.pass_fixed_s)
        w = batch.predicted_s / L * cfg.dilation  # one layer's window
        moves = self.connector != "oracle"
        reads, writes = [], []
        if moves:
            for j, e in zip(jobs, batch.entries):
                if j.first:
                    for p in j.plan.past:  # where each part of the past is (plan.past)
                        src = pe.node if p.area == "pe" else j.io
                        reads.append(([src.host_tx, pe.cnic_rx], p.n * kvb))
                    out = (j.plan.forward_past + e.new) * kvb
                elif j.n_past:  # a later chunk reads its whole past back from the DE buffer
                    reads.append(([j.io.host_tx, pe.cnic_rx], j.n_past * kvb))
                    out = e.new * kvb
                else:
                    out = e.new * kvb
                writes.append(([pe.cnic_tx, j.io.host_rx], out))
        t_c = env.now
        if moves and cal.exposed_io:
            # The testbed's engines move a transfer only while they wait on it (NIXL over UCX/TCP
            # has no progress thread there): each layer's READ and the last layer's WRITE add to
            # the windows instead of hiding behind them. Aggregated: the reads, the windows, the
            # writes, and every transfer's own latency (one READ and one WRITE per request and
            # layer).
            if reads:
                yield simpy.AllOf(env, [self._flow(p, n, (L, w)) for p, n in reads])
            xfers = L * (len(reads) + len(writes))
            wait = L * w + xfers * cal.xfer_latency_s * self.cpu.factor(env.now)
            if wait > 0:
                yield env.timeout(wait)
            if writes:
                yield simpy.AllOf(env, [self._flow(p, n) for p, n in writes if n])
            return env.now
        if reads:
            yield simpy.AllOf(env, [self._flow(p, n) for p, n in reads])
        t_r = env.now
        if not reads or self.connector == "oracle":
            end = t_c + L * w
        elif self.connector == "basic":
            end = t_r + L * w
        else:  # layerwise: layer l+1's READ runs while layer l computes
            d = (t_r - t_c) / L
            end = t_c + min(d, w) + L * max(d, w)
        pending = []
        if writes:  # each layer's KV leaves as its window ends: all but the last layer's now ...
            pending = [self._flow(p, n * (L - 1) / L) for p, n in writes if n]
        if end > env.now:
            yield env.timeout(end - env.now)
        if writes:  # ... and the last layer's at the end; the pass waits for every save
            pending += [self._flow(p, n / L) for p, n in writes if n]
            yield simpy.AllOf(env, pending)
        return env.now

    # ------------------------------------------------------------------ decode engines
    def _decode_admit(self, de: _Engine, job: _DecodeJob, moves: bool, prompt_blocks: int):
        env = self.env
        if moves:
            yield self._flow([de.node.host_tx, de.cnic_rx], job.rec.n_prompt * self.cfg.kv_bytes_per_token)
            if prompt_blocks:  # blocks the prompt itself filled are saved at once (D2H)
                env.process(self._d2h(de, prompt_blocks))
        self.decoders[de.name].add(job)

    def _d2h(self, de: _Engine, blocks: int):
        yield self._flow([de.cnic_tx, de.node.host_rx], blocks * self.cfg.full_block_bytes)

    def _decode_finish(self, de: _Engine, job: _DecodeJob):
        env = self.env
        if job.wb_blocks and self.connector != "oracle":
            yield self._flow([de.cnic_tx, de.node.host_rx], job.wb_blocks * self.cfg.full_block_bytes)
        de.load.finished(job.rec.request)
        yield self._lat(self.cal.rpc_s / 2)  # the answer reaches the conductor
        job.done.succeed()

    # ------------------------------------------------------------------ run
    def run(self) -> SimResult:
        env = self.env
        wall = time.perf_counter()
        self._registered = {g: env.event() for g in self.groups}
        for g in self.groups:
            env.process(self._leader(g))
        for h in self.hosts.values():
            env.process(self._read_worker(h))
        # As on the testbed, whose conductor submits only once every group's leader has started
        # (testbed.cluster.scheduling.ServiceRouter.start) and so reported: a group the scheduler has not
        # heard of yet gets nothing from phase 1, and a burst would all land on the first one.
        env.run(until=simpy.AllOf(env, list(self._registered.values())))
        self.t0 = env.now
        agents = [env.process(self._trace_agent(tr) if tr.trace_turns is not None else self._trajectory(tr))
                  for tr in self.trajectories]
        n_turns = sum(t.n_requests for t in self.trajectories)
        env.run(until=simpy.AllOf(env, agents))  # leaders and read workers loop for ever
        if len(self.records) != n_turns:
            raise RuntimeError(f"simulation of {self.mode} stopped with {len(self.records)} of {n_turns} "
                               f"requests done (a deadlock in the model)")
        return self._result(time.perf_counter() - wall)

    def _result(self, wall_s: float) -> SimResult:
        recs = self.records
        t1 = max((r.t_done for r in recs), default=0.0)
        by_traj: dict[int, float] = {}
        for r in recs:
            by_traj[r.trajectory] = max(by_traj.get(r.trajectory, 0.0), r.t_done)
        arr = {t.id: self.t0 + t.arrival_s for t in self.trajectories}
        links = {l.name: b for l, b in self.net.net.delivered.items()}
        dec = self.decoders.values()
        n_req = max(1, len(recs))
        return SimResult(
            self.mode, recs, self.t0, t1 - self.t0, self.batcher.passes,
            sum(d.segments for d in dec), sum(d.steps for d in dec), sum(d.step_tokens for d in dec),
            links, {"decision_s": self.sched_s, "calls": self.sched_calls,
                    "us_per_request": self.sched_s / n_req * 1e6},
            [by_traj[t] - arr[t] for t in by_traj], self.net.net.events, wall_s,
            {"allocations": self.net.net.allocations, "allocated_flows": self.net.net.allocated_flows})
