"""The request lifecycle's steps (dualpath.lifecycle.steps), performed in the simulated cluster.

ClusterSim (cluster.py) models the cluster: its scheduler service and group leaders, its links,
host agents, prefill passes and decode batches. This mixin is the other half of it: the agents
that submit requests, and how each step of a request's lifecycle takes simulated time there, the
control round trips it costs on the testbed included (the calibration's rpc_s).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import simpy

from dualpath.kv.plan import Route
from dualpath.lifecycle.drive import run_in_process
from dualpath.lifecycle.prefill import PrefillJob
from dualpath.lifecycle.record import RequestRecord
from dualpath.lifecycle.steps import (Allocate, AskRoute, AwaitLayers, Decode, DecodeOutcome, LoadHits, NextInstant,
                                      PassOutcome, PassResult, Prefill, Release, RunPass, WriteBack)
from simulator.agents import TrajectorySpec
from simulator.agents import context_keys as context_keys_of
from simulator.parts import _DecodeJob, _Host

_HANDLERS = {AskRoute: "_ask_route", Allocate: "_allocate", Release: "_release", LoadHits: "_load_hits",
             Prefill: "_prefill", AwaitLayers: "_await_layers", Decode: "_decode", WriteBack: "_write_back",
             NextInstant: "_next_instant", RunPass: "_run_pass"}


class LifecycleSteps:
    """ClusterSim's agents and its executor of the lifecycle's steps (a mixin: it uses the
    cluster's environment, hosts, engines, latencies and flows)."""

    # ------------------------------------------------------------------ the agents
    def _trajectory(self, tr: TrajectorySpec):
        env = self.env
        if tr.arrival_s > 0:
            yield env.timeout(tr.arrival_s)
        bs = self.cfg.block_size
        shared = tr.system_prompt_len // bs
        self.index.add(context_keys_of(tr.id, shared, shared), persisted=True)  # the warm-up's system prompt

        def context_keys(rec: RequestRecord) -> list[int]:
            return context_keys_of(tr.id, shared, (rec.n_prompt + rec.gen_len - 1) // bs)

        ctx = tr.system_prompt_len
        for t, (append, gen) in enumerate(tr.turns):
            prompt_len = ctx + append
            rec = RequestRecord(f"{self.mode}-t{tr.id}-r{t}", tr.id, t, self.mode)
            yield from self._request(rec, prompt_len, gen, context_keys_of(tr.id, shared, prompt_len // bs),
                                     context_keys)
            ctx = prompt_len + gen

    def _trace_agent(self, tr: TrajectorySpec):
        """A replayed trace agent: each turn starts at its trace time, but never before the previous
        turn's answer (an agent waits for its own output). Its turns' keys are the trace's own, so
        agents share the store where their prompts share prefixes."""
        env = self.env
        if tr.arrival_s > 0:
            yield env.timeout(tr.arrival_s)
        arrived = env.now
        for t, turn in enumerate(tr.trace_turns):
            if turn.at_s is not None and arrived + turn.at_s > env.now:
                yield env.timeout(arrived + turn.at_s - env.now)
            rec = RequestRecord(f"{self.mode}-t{tr.id}-r{t}", tr.id, t, self.mode)
            yield from self._request(rec, turn.prompt_len, turn.gen_len, turn.keys, lambda r, k=turn.keys: k)

    def _request(self, rec: RequestRecord, prompt_len: int, gen_len: int, keys: Sequence[int],
                 context_keys: Callable[[RequestRecord], Sequence[int]]):
        """One request: the lifecycle (dualpath.lifecycle.request), its steps performed below."""
        steps = self.lifecycle.request(rec, range(prompt_len), gen_len, keys, context_keys)
        yield from run_in_process(steps, self._perform)
        self.records.append(rec)

    # ------------------------------------------------------------------ the lifecycle's steps
    def _perform(self, step):
        name = _HANDLERS.get(type(step))
        if name is None:
            raise TypeError(f"the simulator cannot perform {type(step).__name__}")
        return getattr(self, name)(step)

    def _ask_route(self, step: AskRoute):
        env, rpc = self.env, self.cal.rpc_s
        rid = step.request.request_id
        decided, delivered = env.event(), env.event()
        self._decided[rid], self._delivered[rid] = decided, delivered
        yield self._lat(rpc / 2)  # the submit reaches the service, which stamps its arrival
        self._service(self.sched.on_request, replace(step.request, arrival=env.now))
        self._ring()
        yield self._lat(rpc / 2)  # its reply
        a = yield decided
        yield delivered
        return Route(a.pe_engine, a.de_engine, a.path.value, a.pe_blocks)

    def _allocate(self, step: Allocate):
        nbytes = step.area.blocks * self.cfg.full_block_bytes
        yield self.hosts[step.area.node].buffer.get(nbytes)
        return nbytes

    def _release(self, step: Release):
        yield self.hosts[step.area.node].buffer.put(step.handle)

    def _load_hits(self, step: LoadHits):
        """The plan's loads from the store, every side at once (a split reads both)."""
        env, fbb = self.env, self.cfg.full_block_bytes
        evs = []
        for ld in step.plan.loads:
            done = env.event()
            evs.append(done)
            env.process(self._load_cmd(self.hosts[ld.node], len(ld.keys) * fbb, done))
        yield simpy.AllOf(env, evs)
        return step.plan.n_hit_blocks

    def _prefill(self, step: Prefill):
        """Queue the request on its PE's prefill batcher (started on the PE's first request)."""
        done = self.env.event()
        job = PrefillJob(step.rec, step.plan, step.rid, step.rec.n_hit, lambda j, e: done.succeed(),
                         io=self.hosts[step.plan.de_node])
        if self.batcher.push(step.plan.route.pe, job):
            self.env.process(run_in_process(self.batcher.passes_of(step.plan.route.pe), self._perform))
        yield done
        return job

    def _await_layers(self, step: AwaitLayers):
        yield self._lat(self.cal.rpc_s)  # wait_notifs: the layers' WRITEs have landed (the pass waited for them)

    def _decode(self, step: Decode):
        """The prompt's KV into the DE's HBM, then the engine's batch."""
        env, plan, rec = self.env, step.plan, step.rec
        de = self.engines[plan.route.de]
        n_wb = plan.writeback.blocks if plan.moves_kv and plan.writeback is not None else 0
        prompt_blocks = (rec.n_prompt // self.cfg.block_size - plan.n_hit_blocks) if plan.moves_kv else 0
        done = env.event()
        djob = _DecodeJob(rec, rec.n_prompt, rec.gen_len, done, max(0, n_wb - prompt_blocks), de.node)
        yield self._lat(self.cal.rpc_s / 2)  # the decode command reaches the engine
        env.process(self._decode_admit(de, djob, plan.moves_kv, prompt_blocks))
        yield done
        first = plan.first_new_block
        return DecodeOutcome(token_times=[step.job.t_first_token, *djob.times],
                             written_blocks=range(first, first + n_wb))

    def _write_back(self, step: WriteBack):
        rpc = self.cal.rpc_s
        yield self._lat(rpc)  # wait_notifs: the write-back's D2H has landed
        yield self._lat(rpc / 2)  # flush reaches the host agent
        yield from self._flush(self.hosts[step.plan.de_node], len(step.keys) * self.cfg.full_block_bytes)
        yield self._lat(rpc / 2)
        return [True] * len(step.keys)

    def _next_instant(self, step: NextInstant):
        yield self.env.timeout(0)

    def _load_cmd(self, host: _Host, nbytes: int, done: simpy.Event):
        env = self.env
        yield self._lat(self.cal.rpc_s / 2)
        landed = env.event()
        self._load(host, nbytes, landed)
        yield landed
        yield self._lat(self.cal.rpc_s / 2)
        done.succeed()

    # ------------------------------------------------------------------ prefill engines
    def _run_pass(self, step: RunPass):
        """One pass's command, the pass, and its reply (the batching is dualpath.lifecycle.prefill)."""
        pe, jobs, batch = self.engines[step.engine], step.jobs, step.batch
        yield self._lat(self.cal.rpc_s / 2)
        t_end = yield from self._pass(pe, jobs, batch)
        for e in batch.entries:
            if e.last:
                pe.load.finished(e.request_id)
        yield self._lat(self.cal.rpc_s / 2)
        share = batch.predicted_s / len(jobs) if jobs else 0.0
        return PassOutcome(t_end, [PassResult(attention_s=share) for _ in jobs],
                           {"attention_s": batch.predicted_s, "predicted_s": batch.predicted_s})
