"""What a reproduction needs run: `dualpath run` configurations, and how long they take.

A `Plan` is the list of `RunConfig`s one figure needs, at full or `--quick` size. A RunConfig
names a topology file (optionally with fields overridden, e.g. a common storage-NIC ratio), the
modes, the compute quota and a `WorkloadSpec`; online configs also carry an `OnlineSpec` (Poisson
arrivals at an APS in agents per *emulated* second). `testbed.reproduce.execute` runs them.

Run times are *estimates* (`estimate`), from first principles calibrated on the README's numbers:
the demo (24 agents, 234 turns, 5 modes on 1p1d-io) takes about 3.5 minutes. Per mode the run
lasts the longest of
  * reading every hit byte through the storage NICs that read in that mode (P nodes for basic
    and layerwise, P + D for the dual-path modes, none for oracle) at their payload rate;
  * the longest trajectory's own chain of turns, each a prefill pass of it alone plus its decode
    steps, in the target's time times the dilation;
  * the prefill engines' total work spread over all of them;
  * the decode engines' total work spread over all of them, each step's fixed cost shared by a
    batch as large as the target's decode HBM holds at the workload's mean context;
  * writing each turn's new KV back through the DE nodes' SNICs (fig14's burst: 82 s estimated
    without it, 365 s measured, 310 s with it);
  * for online runs, the arrival span plus the last agent's chain;
plus the cluster's start, each mode's warm-up, and verification of every request against a
recomputation. Good to within a factor of about 1.5; the real JCTs land in each run's summary.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from dualpath.workload import generate, turn_hits
from dualpath.workload.spec import WorkloadSpec  # noqa: F401  (the configs' vocabulary, re-exported)
from dualpath.workload.trace import TraceSpec
from testbed.topology import TOPOLOGIES, topology_with

RUN_BLOCK_TOKENS = 32  # = testbed.experiments.ablation.RUN_BLOCK_TOKENS (not imported: that pulls in the cluster)
DEMO_KV_BYTES_PER_TOKEN = 2048  # = dualpath.model.tiny.DEMO_KV_BYTES_PER_TOKEN (the demo checkpoint)
PAPER_SCALE = 32  # the paper presets' lengths are divided by this (64K MaxLen -> 2048, the demo's)
# The offline figures on 1p1d-io run its links at this scale, stated in the run's name. It is
# now the file's own scale too (it was x0.0025, where the dualpath mode kept both cores 84-88 %
# busy, over the fidelity rule's 85 %); kept as an override so the committed runs' configs and
# names stay what they were. Emulated times do not depend on the scale (the dilation k absorbs
# it: x0.0016 gives k = 4.9 instead of 3.1); only the testbed's run time and its CPU headroom do.
IO_1P1D_OVERRIDES = {"scale": 0.0016}

# Calibration of the estimate (see the module docstring).
SETUP_S = 15.0  # cluster up, checkpoint load, store warm
MODE_OVERHEAD_S = 2.0  # a mode's warm-up and drain
# Verification (testbed/cluster/verify.py): the recomputation runs once whatever the modes (their
# prompts are the same, and each is computed once), its trajectories in lockstep; each mode then
# costs its requests' KV hashes and comparisons. Fitted on two profiled runs of 1p1d-io's 24
# agents (237 requests, 158,467 prompt tokens; `dualpath profile run`, verification_wall_s):
# 5.7 s with one mode checked, 8.3 s with four. (Before the lockstep recomputation: 9e-5 s per
# prompt token per mode, 14 s and 57 s for those two.)
VERIFY_START_S = 1.5  # the worker processes' start: torch, the model
VERIFY_S_PER_TOKEN = 2.1e-5  # per prompt token, once
VERIFY_S_PER_CHECK = 3.6e-3  # per request of each mode checked
# With collectives on, every pass and step also exchanges over the CNICs, which the chain model
# leaves out; under QoS off each exchange also waits behind part of the KV load's FIFO. Measured
# on the committed isolation runs (results/reproduce/isolation/runs, 16 agents at half the turns
# and 24 at all of them): idle took 1.49x and 1.51x its estimate, QoS on 1.02x and 1.05x idle, QoS
# off 2.81x and 3.43x idle (more in the longer run, as the FIFO fills); the larger of each is used.
COLLECTIVES_SLOWDOWN = 1.51
KV_LOAD_SLOWDOWN = {"qos_on": 1.05, "qos_off": 3.43}
READERS = {"basic": "P", "layerwise": "P", "dualpath-rr": "PD", "dualpath": "PD", "dualpath-split": "PD",
           "oracle": "",
           # the isolation run's conditions: each an oracle pass of the workload (testbed/experiments/isolation.py)
           "idle": "", "qos_on": "", "qos_off": ""}


@dataclass(frozen=True)
class OnlineSpec:
    """Online serving: agents arrive as a Poisson process at `aps` agents per emulated second."""

    aps: float
    seed: int = 0


@dataclass
class RunConfig:
    """One `dualpath run`: where (topology), what (modes, workload) and how (quota, arrivals).
    `params` are the coordinates the analysis reads (e.g. {"max_len": "64K", "agents": 16})."""

    key: str
    topology: str
    modes: tuple[str, ...]
    workload: WorkloadSpec
    topology_overrides: dict[str, Any] = field(default_factory=dict)
    quota_ms: int = 300
    online: OnlineSpec | None = None
    params: dict[str, Any] = field(default_factory=dict)
    trace: TraceSpec | None = None  # a replayed trace instead of the generated `workload`

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["modes"] = list(self.modes)
        if self.trace is None:
            d.pop("trace")  # the digests of configs from before traces stay what they were
        else:
            d["trace"] = self.trace.to_dict()
        return d

    def digest(self) -> str:
        """Identity of what is run (not of its name): runs with equal digests are interchangeable."""
        d = self.to_dict()
        d.pop("key")
        d.pop("params")
        return hashlib.sha1(json.dumps(d, sort_keys=True).encode()).hexdigest()[:10]

    def folder(self) -> str:
        """The run's folder name: from what is run, not from the key, so configs of one digest
        (e.g. fig9's x1 on both sides, fig13's and fig14's run) share one folder."""
        w = self.workload
        what = f"trace{self.trace.limit or ''}" if self.trace else f"{w.preset}-{w.agents}a"
        name = f"{self.topology}-{what}" + (f"-{self.online.aps:g}aps" if self.online else "")
        return re.sub(r"[^A-Za-z0-9_.=-]+", "_", name)[:80] + "-" + self.digest()

    def topology_obj(self):
        """The validated topology, with the overrides applied (its name says so)."""
        return topology_with(self.topology, self.topology_overrides)

    def describe(self) -> str:
        over = f" with {self.topology_overrides}" if self.topology_overrides else ""
        online = f", Poisson arrivals at {self.online.aps:g} APS (seed {self.online.seed})" if self.online else ""
        what = self.trace.describe() if self.trace else self.workload.describe()
        return (f"{self.key}: {self.topology}{over}; modes {','.join(self.modes)}; {what}"
                f"{online}; quota {self.quota_ms} ms")


@dataclass(frozen=True)
class OnlineSearch:
    """After the APS grid, bisect each mode's highest APS meeting the SLO to `rel_tol`."""

    modes: tuple[str, ...]
    rel_tol: float = 0.1
    max_probes: int = 6


@dataclass
class Plan:
    id: str
    quick: bool
    configs: list[RunConfig]
    scale_down: str
    notes: list[str] = field(default_factory=list)
    search: OnlineSearch | None = None
    seeds: int = 1  # workloads each run is repeated on (with_seeds)

    @property
    def needs_online(self) -> bool:
        return any(c.online for c in self.configs)

    @property
    def needs_testbed(self) -> bool:
        return bool(self.configs)

    def with_seed(self, offset: int) -> "Plan":
        """The same plan on other workloads: every run's seeds (its workload's or trace's, and its
        arrivals') moved by `offset`, so its runs are new ones (their digests change) that a
        committed run did not see. 0 is the plan itself."""
        if offset == 0:
            return self
        if offset < 0:
            raise ValueError(f"a seed offset is >= 0, not {offset}")
        note = f"every run's workload and arrival seeds offset by {offset} (--seed {offset})"
        return replace(self, configs=[_moved(c, offset) for c in self.configs], notes=[*self.notes, note])

    def with_seeds(self, n: int) -> "Plan":
        """Every run repeated on `n` workloads (seeds +0 .. +n-1), for analyses that pool them
        (`replica_keys`). The repeats' keys are the run's key with SEED_KEY and the offset."""
        if n < 1:
            raise ValueError(f"--seeds is at least 1, not {n}")
        if n > 1 and self.needs_online:
            raise ValueError(f"{self.id} searches an APS bracket per mode; it does not repeat its runs over seeds")
        base = [c for c in self.configs if SEED_KEY not in c.key]
        reps = [replace(_moved(c, i), key=f"{c.key}{SEED_KEY}{i}") for i in range(1, n) for c in base]
        notes = [x for x in self.notes if not x.startswith("every run repeated on")]
        if n > 1:
            notes.append(f"every run repeated on {n} workloads (seeds +0 to +{n - 1}) and pooled")
        return replace(self, configs=base + reps, seeds=n, notes=notes)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "quick": self.quick, "scale_down": self.scale_down, "notes": self.notes, "seeds": self.seeds,
                "needs_online_runner": self.needs_online,
                "search": asdict(self.search) if self.search else None,
                "configs": [{**c.to_dict(), "digest": c.digest(), "estimate_s": estimate(c)["total_s"]}
                            for c in self.configs],
                "estimate_s": self.estimate_s()}

    def estimate_s(self) -> float:
        """All configs, plus the bisection probes of an online search (one mode each)."""
        uniq = {c.digest(): c for c in self.configs}.values()  # configs of one digest are one run
        total = sum(estimate(c)["total_s"] for c in uniq)
        if self.search and self.configs:
            per = max(estimate(c)["total_s"] for c in self.configs)
            total += len(self.search.modes) * self.search.max_probes * per / max(1, len(self.configs[0].modes))
        return round(total, 1)

    def lines(self) -> list[str]:
        size = "quick" if self.quick else "full"
        runs = len({c.digest() for c in self.configs})
        out = [f"{self.id} ({size}): {runs} run(s), estimated {_dur(self.estimate_s())}",
               f"  scale-down: {self.scale_down}"]
        for c in self.configs:
            e = estimate(c)
            per = ", ".join(f"{m} {_dur(t)} ({e['limited_by'][m]})" for m, t in e["per_mode_s"].items())
            out.append(f"  - {c.describe()}")
            out.append(f"      ~{_dur(e['total_s'])} in all (verification {_dur(e['verify_s'])}); per mode {per}")
        if self.search:
            out.append(f"  then per mode ({', '.join(self.search.modes)}) up to {self.search.max_probes} bisection "
                       f"runs to {self.search.rel_tol:.0%} of the highest APS under the SLO")
        out += [f"  note: {n}" for n in self.notes]
        return out


SEED_KEY = "#seed+"  # a repeated run's key: "<key>#seed+<offset>"


def replica_keys(key: str, seeds: int) -> list[str]:
    """The keys of a run and its repeats on other seeds (Plan.with_seeds)."""
    return [key] + [f"{key}{SEED_KEY}{i}" for i in range(1, seeds)]


def _moved(c: RunConfig, offset: int) -> RunConfig:
    """The config on other workloads: its workload's (or trace's) and arrivals' seeds + offset."""
    return replace(c, workload=replace(c.workload, seed=c.workload.seed + offset),
                   online=replace(c.online, seed=c.online.seed + offset) if c.online else None,
                   trace=replace(c.trace, seed=c.trace.seed + offset) if c.trace else None)


def _dur(s: float) -> str:
    return f"{s / 60:.1f} min" if s >= 90 else f"{s:.0f} s"


def in_repo(spec: TraceSpec) -> TraceSpec:
    """A config's trace with a relative path read from this checkout (configs name the repository's
    own traces relatively, so that their digests do not depend on where it was cloned)."""
    p = Path(spec.path)
    return spec if p.is_absolute() else replace(spec, path=str(TOPOLOGIES.parent / p))


# --------------------------------------------------------------------------- the estimate


@lru_cache(maxsize=256)
def _workload_numbers(spec: WorkloadSpec | TraceSpec) -> dict[str, Any]:
    span = 0.0  # a replayed trace's arrival span, emulated s
    if isinstance(spec, TraceSpec):
        from dualpath.workload.trace import load_trace

        tw = load_trace(in_repo(spec), RUN_BLOCK_TOKENS)
        wl, span = tw.workload(RUN_BLOCK_TOKENS), tw.span_s()
    else:
        wl = generate(spec.config())
    hits = iter(turn_hits(wl.trajectories, RUN_BLOCK_TOKENS))  # one store for every trajectory (a trace's prefixes)
    per_traj = []
    turns = []
    for tr in wl.trajectories:
        hs = [next(hits) for _ in tr.turns]
        per_traj.append([(h.hit, h.prompt_len - h.hit, u.gen_len, h.prompt_len) for h, u in zip(hs, tr.turns)])
        turns += per_traj[-1]
    return {"per_traj": per_traj, "turns": turns, "hit_tokens": sum(t[0] for t in turns), "requests": len(turns),
            "prompt_tokens": sum(t[3] for t in turns), "span_s": span}


def estimate(cfg: RunConfig) -> dict[str, Any]:
    """Estimated testbed seconds of one config: per mode, and in all (see the module docstring)."""
    from testbed.measure.fidelity import payload_share

    topo = cfg.topology_obj()
    wn = _workload_numbers(cfg.trace or cfg.workload)
    k = topo.dilation(DEMO_KV_BYTES_PER_TOKEN)
    tgt = topo.target()
    pc, dc = tgt.prefill_cost(), tgt.decode_cost()
    p, d, g = topo.spec.prefill_nodes, topo.spec.decode_nodes, topo.g
    snic = topo.snic_bps / 8 * payload_share(topo.spec.mtu)
    hit_bytes = wn["hit_tokens"] * DEMO_KV_BYTES_PER_TOKEN

    def chain(turns) -> float:  # emulated s of one trajectory alone
        return sum(pc.predict([(hit, miss)]) + gen * dc.step_cost([ctx]) for hit, miss, gen, ctx in turns)

    serial = max((chain(t) for t in wn["per_traj"]), default=0.0) * k
    pe_work = sum(pc.request_cost(hit, miss) for hit, miss, _, _ in wn["turns"]) * k / (p * g)
    de_work = decode_work(wn["turns"], dc, topo.hbm_plan(DEMO_KV_BYTES_PER_TOKEN).decode.tokens) * k / (d * g)
    # each turn's new KV goes back to storage through the DE node's SNIC (tx: apart from the reads)
    write_bytes = sum(miss + gen for _, miss, gen, _ in wn["turns"]) * DEMO_KV_BYTES_PER_TOKEN
    span = wn["span_s"] * k
    if cfg.online:
        span = (cfg.workload.agents - 1) / cfg.online.aps * k
    per_mode, limited = {}, {}
    for m in cfg.modes:
        readers = {"P": p, "PD": p + d, "": 0}[READERS.get(m, "P")]
        io = hit_bytes / (readers * snic) if readers else 0.0
        wb = write_bytes / (d * snic) if readers else 0.0
        chain_s = span + serial
        t = max(io, wb, chain_s, pe_work, de_work)
        limited[m] = ("storage NICs" if t == io else "the write-back" if t == wb else "prefill engines" if t == pe_work
                      else "decode engines" if t == de_work else
                      "arrivals" if cfg.online or wn["span_s"] else "the longest agent's chain of turns")
        if topo.spec.collectives:
            t *= COLLECTIVES_SLOWDOWN * KV_LOAD_SLOWDOWN.get(m, 1.0)
            limited[m] += ", with collectives" + (" behind the KV load" if m in KV_LOAD_SLOWDOWN else "")
        per_mode[m] = round(t + MODE_OVERHEAD_S, 1)
    checked = sum(READERS.get(m, "P") != "" for m in cfg.modes)
    verify = (VERIFY_START_S + VERIFY_S_PER_TOKEN * wn["prompt_tokens"]
              + VERIFY_S_PER_CHECK * wn["requests"] * checked) if checked else 0.0
    total = SETUP_S + sum(per_mode.values()) + verify
    return {"per_mode_s": per_mode, "limited_by": limited, "verify_s": round(verify, 1), "total_s": round(total, 1),
            "hit_bytes": hit_bytes, "requests": wn["requests"], "dilation": k}


def decode_work(turns, dc, hbm_tokens: int) -> float:
    """Emulated decode seconds of every turn, summed over engines: each token's share of its
    step, batches as large as the decode HBM holds at the mean context (a step's fixed cost is
    shared by its batch)."""
    gens = sum(gen for *_, gen, _ in turns)
    if not gens:
        return 0.0
    mean_ctx = sum(ctx * gen for *_, gen, ctx in turns) / gens
    batch = max(1, int(hbm_tokens // max(1.0, mean_ctx)))
    own = sum(gen * (dc.step_cost([ctx]) - dc.intercept) for *_, gen, ctx in turns)
    return own + gens / batch * dc.intercept


def io_capacity_aps(cfg: RunConfig, mode: str) -> float:
    """Agents per emulated second the reading storage NICs can serve in `mode` (its I/O bound)."""
    from testbed.measure.fidelity import payload_share

    topo = cfg.topology_obj()
    wn = _workload_numbers(replace(cfg.workload))
    readers = {"P": topo.spec.prefill_nodes, "PD": topo.spec.prefill_nodes + topo.spec.decode_nodes,
               "": 0}[READERS.get(mode, "P")]
    if not readers:
        return math.inf
    per_agent = wn["hit_tokens"] * DEMO_KV_BYTES_PER_TOKEN / max(1, cfg.workload.agents)
    snic = topo.snic_bps / 8 * payload_share(topo.spec.mtu)
    return readers * snic / per_agent * topo.dilation(DEMO_KV_BYTES_PER_TOKEN)
