"""Decision cost of the scheduler at cluster scale: PE assign + DE assign + path choice per request.

Builds the paper's largest deployment by default: 1,152 engines = 48 prefill + 96 decode nodes of 8
GPUs, one engine group per node. Each round refreshes every engine's report with realistic load
(some PEs overloaded, read queues on both sides of alpha, DE HBM partly full; not timed), submits
a batch of requests, then times the pulls that place them all. The cost of a round divided by the
requests it placed is one sample; the median over rounds is the figure of merit (budget 50 us).

    python -m testbed.calibrate.benches.scheduler [--engines 1152] [--requests 20000] [--batch 32 1]
                                       [--policy shorter|rr|split|pe] [--nodes-per-group 1]
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from dualpath.scheduler.core import Scheduler
from dualpath.scheduler.records import EngineReport, Request, Role
from dualpath.scheduler.thresholds import Profile

BUDGET_US = 50.0

# DeepSeek-V3-like numbers; only their ratios to the request sizes matter for the cost.
BENCH_PROFILE = Profile(
    snic_bytes_per_s=50e9,  # 400 Gbit/s SNIC
    prefill_tokens_per_s=20_000.0,
    kv_bytes_per_token=70_000,
    block_tokens=64,
)


def _reports(rng: random.Random, n_engines: int, gpus_per_node: int, prefill_fraction: float,
             profile: Profile, alpha_s: float, beta_s: float, nodes_per_group: int = 1) -> list[EngineReport]:
    n_nodes = n_engines // gpus_per_node
    n_p = max(1, round(n_nodes * prefill_fraction))
    alpha = alpha_s * profile.snic_bytes_per_s
    beta = beta_s * profile.prefill_tokens_per_s
    out = []
    for n in range(n_nodes):
        pre = n < n_p
        read_q = int(rng.uniform(0, 2 * alpha))  # about half the nodes in C2, half in C3
        grp = n // nodes_per_group if pre else (n - n_p) // nodes_per_group
        for g in range(gpus_per_node):
            if pre:
                tok = int(rng.uniform(0, 1.5 * beta))  # about a third overloaded (C1)
                out.append(EngineReport(f"p{n}.{g}", f"pn{n}", Role.PREFILL, f"pg{grp}",
                                        max(1, tok // 30_000), tok, 0, 0, read_q))
            else:
                tok = int(rng.uniform(0, 400_000))
                free = int(rng.uniform(50_000, 600_000))
                out.append(EngineReport(f"d{n}.{g}", f"dn{n}", Role.DECODE, f"dg{grp}",
                                        tok // 30_000, tok, free, free * profile.kv_bytes_per_token, read_q))
    return out


def bench_decision_cost(
    n_engines: int = 1152,
    n_requests: int = 20_000,
    batch: int = 32,
    gpus_per_node: int = 8,
    prefill_fraction: float = 1 / 3,  # 48P96D
    path_policy: str = "shorter",
    seed: int = 0,
    nodes_per_group: int = 1,  # engine group = this many nodes (the paper's EP groups may span nodes)
) -> dict:
    """Median (and p90/p99) per-request decision cost in microseconds; see the module doc."""
    if n_engines % gpus_per_node:
        raise ValueError("n_engines must be a multiple of gpus_per_node")
    rng = random.Random(seed)
    t = [0.0]
    sched = Scheduler(BENCH_PROFILE, path_policy=path_policy, clock=lambda: t[0])
    def reports() -> list[EngineReport]:
        return _reports(rng, n_engines, gpus_per_node, prefill_fraction, BENCH_PROFILE, 3.0, 5.0, nodes_per_group)

    sched.on_reports(reports())
    pe_groups = sorted(g for g, s in sched.groups.items() if s.role is Role.PREFILL)
    de_groups = sorted(g for g, s in sched.groups.items() if s.role is Role.DECODE)
    samples_us: list[float] = []
    placed_total = 0
    rid = 0
    pe_turn = 0
    n_rounds = max(1, n_requests // batch)
    refresh_every = max(1, 32 // batch)  # keep report churn per request about constant
    for rnd in range(n_rounds):
        # untimed: the cluster drains and reports afresh; leaders collect their deliveries
        if rnd % refresh_every == 0:
            sched.on_reports(reports())
        for g in pe_groups:
            sched.pull(g)
        reqs = []
        for _ in range(batch):
            total = rng.randint(1_000, 64_000)
            hit = int(total * 0.987) // 64 * 64
            reqs.append(Request(f"r{rid}", total, hit, total - hit, t[0]))
            rid += 1
        t[0] += 0.01
        elapsed, placed, pe_turn = _timed_round(sched, reqs, pe_groups, rng.choice(de_groups), pe_turn)
        if placed:
            samples_us.append(elapsed / 1e3 / placed)
            placed_total += placed
        sched.cancel_waiting()  # untimed: rounds stay independent
    samples_us.sort()
    q = statistics.quantiles(samples_us, n=100) if len(samples_us) > 1 else samples_us * 99
    median = statistics.median(samples_us)
    return {
        "n_engines": n_engines,
        "pe_groups": len(pe_groups),
        "de_groups": len(de_groups),
        "engines_per_group": gpus_per_node * nodes_per_group,
        "batch": batch,
        "rounds": len(samples_us),
        "requests_placed": placed_total,
        "path_policy": path_policy,
        "median_us": median,
        "p90_us": q[89],
        "p99_us": q[98],
        "budget_us": BUDGET_US,
        "ratio_to_budget": median / BUDGET_US,
    }


def _timed_round(sched: Scheduler, reqs: list[Request], pe_groups: list, de_group, pe_turn: int
                 ) -> tuple[int, int, int]:
    """One round's decisions, timed: (nanoseconds, requests placed on a DE, the next PE turn)."""
    placed = 0
    start = time.perf_counter_ns()
    for r in reqs:
        sched.on_request(r)
    # PE groups pull in turn until the waiting queue is empty (bounded: one pass over groups)
    for _k in range(len(pe_groups)):
        if not sched.pe_waiting:
            break
        sched.pull(pe_groups[pe_turn % len(pe_groups)])
        pe_turn += 1
    # one DE pull distributes the global queue (phase 1) ...
    placed += len(sched.pull(de_group))
    elapsed = time.perf_counter_ns() - start
    # ... then each group with work places its share (finding them is the harness's job)
    with_work = sched.de_groups_with_work()
    start = time.perf_counter_ns()
    for g in with_work:
        placed += len(sched.pull(g))
    return elapsed + time.perf_counter_ns() - start, placed, pe_turn


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, default=1152)
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--batch", type=int, nargs="+", default=[32, 1])
    ap.add_argument("--policy", default="shorter", choices=["shorter", "rr", "split", "pe"])
    ap.add_argument("--nodes-per-group", type=int, default=1)
    a = ap.parse_args(argv)
    for b in a.batch:
        r = bench_decision_cost(a.engines, a.requests if b > 1 else min(a.requests, 5_000), b, path_policy=a.policy,
                                nodes_per_group=a.nodes_per_group)
        print(
            f"engines={r['n_engines']} ({r['pe_groups']} PE + {r['de_groups']} DE groups of "
            f"{r['engines_per_group']}) batch={b} "
            f"policy={r['path_policy']} placed={r['requests_placed']}: median {r['median_us']:.1f} us/request "
            f"(p90 {r['p90_us']:.1f}, p99 {r['p99_us']:.1f}), {r['ratio_to_budget']:.2f}x the {BUDGET_US:.0f} us budget"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
