"""A Mooncake-format trace replayed as agents: sessions from prefixes, arrivals from timestamps.

The trace (dualpath.workload.mooncake) has no session ids. Its multi-turn structure is in its
prefixes, and this module recovers it with one rule:

  **A request continues an earlier one when its hash_ids begin with all of that request's
  full-block ids** (the ids of the trace blocks its prompt fills completely; a partial tail
  block's id is not one of them, and a request with no full block continues nothing). Of the
  earlier requests it continues, the most recent one that has no continuation yet wins.

Chained requests are the turns of one agent (a session). A turn starts when the trace says
(its timestamp), but never before the previous turn's answer: a replayed agent waits for its own
output. A request that continues nothing starts a session of its own (a single-turn agent if
nothing continues it either). `--offline` drops the timestamps: every agent starts at once and
each turn follows the previous answer at once.

A turn's prompt is the trace request's own tokens, derived from its hash ids (mooncake.py), not
the previous prompt plus the replayed model's answer: the trace knows its own answers, the
replayed model writes others. Requests that share hash ids therefore share the token prefix
exactly, and so the store's chained keys.

`trace_block_hit_rate` is what the trace's prefix structure allows with an unbounded store,
counted straight from the file: a request hits the leading run of its full trace blocks whose
prefix an earlier request's full blocks already held, token-weighted over the requests (in the
trace's own tokens). A run's hit rate can differ from it where a request starts before an
earlier one sharing its prefix has written it back (concurrent requests), and by at most one
Full Block where a prompt is entirely stored (every prefill computes at least one token).

The warm-up. Agents whose first turns share a prefix and start together (offline, all of them;
online, within CONCURRENT_S emulated seconds of one another) could not find it in the store: none
has written it back yet. As a generated workload's mode persists its shared system prompt before
its first request, a replay persists those prefixes first (at most MAX_WARM, the most shared
first), and so the first agent of each hits it too, one prefix more than the trace count. First
turns further apart find what the earlier one wrote back, as the count says. Where nothing is
warmed, the warm-up is one Full Block no trace prompt shares (it still exercises every path once,
its bytes accounted like any request's). The summary's `trace.warm` says what was warmed.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Sequence

import numpy as np

from .mooncake import MOONCAKE_BLOCK, TraceError, TraceRequest, load_mooncake
from .trajectories import DEFAULT_VOCAB, RESERVED_TOKENS, Trajectory, Turn, Workload, WorkloadConfig

MAX_WARM = 16  # warm-up prompts per mode at most
CONCURRENT_S = 0.1  # emulated s: first turns sharing a prefix this close together overlap (the warm-up)
_TAG_WARM = 0x5741  # "WA": the tokens of a warm-up block no trace prompt shares


@dataclass(frozen=True)
class TraceSpec:
    """Which requests of a trace file, at which scale and on which clock (the CLI's --trace
    options; reproduce's configs carry the same)."""

    path: str
    length_scale: int = 1  # every length divided by this (must divide the trace's 512-token block)
    limit: int | None = None  # the first N requests (after the window)
    window: tuple[float, float] | None = None  # [A, B) seconds of trace time
    agents: int | None = None  # the first N sessions
    offline: bool = False  # every agent at once, turns back to back
    time_scale: float = 1.0  # trace seconds per emulated second (> 1 compresses the trace's clock)
    gen_scale: float = 1.0  # every output length times this
    seed: int = 0  # salts the token ids derived from hash ids

    def check(self, run_block: int) -> None:
        """Refuse, with one line, what cannot be replayed on Full Blocks of `run_block` tokens."""
        s = self.length_scale
        if not isinstance(s, int) or s < 1 or MOONCAKE_BLOCK % s:
            raise ValueError(f"--length-scale {s}: must divide the trace block of {MOONCAKE_BLOCK} tokens "
                             f"(1, 2, 4, ..., {MOONCAKE_BLOCK})")
        block = MOONCAKE_BLOCK // s
        if block % run_block and run_block % block:  # both are powers of two here; a run's block may not be
            raise ValueError(f"--length-scale {s}: a trace block becomes {block} tokens, which neither holds whole "
                             f"{run_block}-token Full Blocks nor fills one with whole trace blocks")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"--trace-limit {self.limit}: must be >= 1")
        if self.agents is not None and self.agents < 1:
            raise ValueError(f"--agents {self.agents}: must be >= 1")
        if self.window is not None and not (0 <= self.window[0] < self.window[1]):
            raise ValueError(f"--trace-window {self.window[0]:g}:{self.window[1]:g}: need 0 <= A < B seconds")
        if not self.time_scale > 0 or not math.isfinite(self.time_scale):
            raise ValueError(f"--time-scale {self.time_scale}: must be > 0")
        if not self.gen_scale > 0 or not math.isfinite(self.gen_scale):
            raise ValueError(f"--gen-scale {self.gen_scale}: must be > 0")

    def block_tokens(self) -> int:
        return MOONCAKE_BLOCK // self.length_scale

    def describe(self) -> str:
        bits = [f"trace {self.path}", f"lengths /{self.length_scale} ({self.block_tokens()}-token hash blocks)"]
        if self.window:
            bits.append(f"window {self.window[0]:g}-{self.window[1]:g} s")
        if self.limit:
            bits.append(f"first {self.limit} requests")
        if self.agents:
            bits.append(f"first {self.agents} sessions")
        if self.gen_scale != 1:
            bits.append(f"generations x{self.gen_scale:g}")
        bits.append("offline" if self.offline else f"arrivals from timestamps{f' / {self.time_scale:g}' if self.time_scale != 1 else ''}")
        return ", ".join(bits)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["window"] = list(self.window) if self.window else None
        return d


def parse_window(text: str) -> tuple[float, float]:
    """'A:B' seconds of trace time -> (A, B); one-line ValueError otherwise."""
    try:
        a, b = (float(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"--trace-window {text[:40]!r}: expected A:B, seconds of trace time (e.g. 0:60)") from None
    if not (math.isfinite(a) and math.isfinite(b) and 0 <= a < b):
        raise ValueError(f"--trace-window {text[:40]!r}: need 0 <= A < B")
    return a, b


# --------------------------------------------------------------------------- structure


def select(requests: Sequence[TraceRequest], spec: TraceSpec) -> list[TraceRequest]:
    """The requests the spec names: those in the window, then the first `limit` of them."""
    out = [r for r in requests if spec.window is None or spec.window[0] <= r.arrival_s < spec.window[1]]
    return out[:spec.limit] if spec.limit is not None else out


def _chain(ids: Sequence[int]) -> list[int]:
    """Rolling keys of every prefix of `ids`: key j identifies ids[:j + 1]."""
    out, key = [], 0
    for h in ids:
        key = hash((key, h))
        out.append(key)
    return out


def chain_sessions(requests: Sequence[TraceRequest]) -> list[list[int]]:
    """The sessions (the module's rule), each a list of positions in `requests`, in turn order;
    sessions are ordered by their first request."""
    open_by_prefix: dict[int, list[int]] = {}  # key of a request's full ids -> positions without a continuation
    session_of: list[int] = []
    sessions: list[list[int]] = []
    for i, r in enumerate(requests):
        best = -1
        for key in _chain(r.hash_ids):
            waiting = open_by_prefix.get(key)
            if waiting and waiting[-1] > best:
                best = waiting[-1]
        if best >= 0:
            prev = requests[best]
            open_by_prefix[_chain(prev.full_ids)[-1]].remove(best)
            session_of.append(session_of[best])
            sessions[session_of[best]].append(i)
        else:
            session_of.append(len(sessions))
            sessions.append([i])
        if r.full_blocks:
            open_by_prefix.setdefault(_chain(r.full_ids)[-1], []).append(i)
    return sessions


def trace_block_hit_rate(requests: Sequence[TraceRequest]) -> dict:
    """The hit rate the trace's prefixes allow with an unbounded store (the module docstring),
    in the trace's own tokens: {hit_tokens, prompt_tokens, rate, hit_blocks, blocks}."""
    seen: set[int] = set()
    hit_tokens = prompt_tokens = hit_blocks = blocks = 0
    for r in requests:
        keys = _chain(r.full_ids)
        n = 0
        while n < len(keys) and keys[n] in seen:
            n += 1
        seen.update(keys)
        hit_blocks += n
        blocks += len(r.hash_ids)
        hit_tokens += n * MOONCAKE_BLOCK
        prompt_tokens += r.trace_input_length
    return {"hit_tokens": hit_tokens, "prompt_tokens": prompt_tokens,
            "rate": round(hit_tokens / prompt_tokens, 6) if prompt_tokens else 0.0,
            "hit_blocks": hit_blocks, "blocks": blocks}


def block_keys(r: TraceRequest, block_size: int) -> tuple[int, ...]:
    """Chained keys of the prompt's full `block_size`-token blocks, from its hash ids alone (the
    simulator's store, without materializing tokens): equal keys exactly where `tokens()` gives
    equal token prefixes. A Full Block is a piece of one hash block (the same tokens wherever that
    id is), or whole hash blocks when they are smaller (a full block never holds a partial tail)."""
    def tag(j: int) -> tuple:
        return ("h", r.hash_ids[j]) if j < len(r.hash_ids) else ("u", r.index, j)

    out, key = [], 0
    for b in range(r.input_length // block_size):
        if block_size <= r.block_tokens:
            j, i = divmod(b * block_size, r.block_tokens)
            key = hash((key, tag(j), i))
        else:
            per = block_size // r.block_tokens
            key = hash((key, tuple(tag(j) for j in range(b * per, (b + 1) * per))))
        out.append(key)
    return tuple(out)


# --------------------------------------------------------------------------- the workload


@dataclass(frozen=True)
class TraceWorkload:
    """A trace's selection as sessions, ready to replay."""

    spec: TraceSpec
    requests: tuple[TraceRequest, ...]
    sessions: tuple[tuple[int, ...], ...]  # positions in `requests`
    hits: dict = field(default_factory=dict)  # trace_block_hit_rate of the requests

    def stats(self) -> dict:
        """The summary's `trace` object, less the run's own hit rate."""
        span = self.span_s()
        toks = sum(r.input_length + r.output_length for r in self.requests)
        warm = self.shared_prefixes
        return {"file": self.spec.path, "requests": len(self.requests), "sessions": len(self.sessions),
                "chained_turns": len(self.requests) - len(self.sessions),
                "turns_max": max((len(s) for s in self.sessions), default=0),
                "trace_block_hit_rate": self.hits["rate"], "trace_hits": self.hits,
                "length_scale": self.spec.length_scale, "block_tokens": self.spec.block_tokens(),
                "offline": self.spec.offline, "time_scale": self.spec.time_scale,
                "warm": {"prefixes": len(warm), "trace_tokens": sum(n * MOONCAKE_BLOCK for _, n in warm)},
                "span_emulated_s": round(span, 3),
                "offered": {"agents_per_s": round(len(self.sessions) / span, 4) if span else None,
                            "tokens_per_s": round(toks / span, 1) if span else None,
                            "unit": "per emulated second"},
                "spec": self.spec.to_dict()}

    def span_s(self) -> float:
        """Emulated seconds from the first request's arrival to the last one's (0 offline)."""
        if self.spec.offline or not self.requests:
            return 0.0
        ts = [r.arrival_s for r in self.requests]
        return (max(ts) - min(ts)) / self.spec.time_scale

    def t0(self) -> float:
        return min((r.arrival_s for r in self.requests), default=0.0)

    def gen_len(self, r: TraceRequest) -> int:
        return max(1, round(r.output_length * self.spec.gen_scale))

    def arrivals(self, seconds_per_emulated_s: float = 1.0) -> list[tuple[float, list[float | None]]]:
        """Per session: its agent's arrival and each turn's earliest start after it, in emulated
        seconds times `seconds_per_emulated_s` (the dilation, for testbed seconds)."""
        k = seconds_per_emulated_s / self.spec.time_scale
        t0 = self.t0()
        out = []
        for s in self.sessions:
            if self.spec.offline:
                out.append((0.0, [None] * len(s)))
                continue
            first = self.requests[s[0]].arrival_s
            out.append(((first - t0) * k, [(self.requests[i].arrival_s - first) * k for i in s]))
        return out

    def workload(self, block_size: int, seconds_per_emulated_s: float = 1.0) -> Workload:
        """The sessions as trajectories with explicit prompts; arrivals in emulated seconds times
        `seconds_per_emulated_s`."""
        trajs = []
        for sid, (s, (arrive, ats)) in enumerate(zip(self.sessions, self.arrivals(seconds_per_emulated_s))):
            turns = tuple(Turn((), self.gen_len(self.requests[i]), prompt=self.requests[i].tokens(), at_s=at)
                          for i, at in zip(s, ats))
            trajs.append(Trajectory(sid, (), turns, arrival_s=arrive))
        return Workload(self.config(), (), tuple(trajs), warm_prompts=self.warm_prompts(block_size),
                        trace=self.stats())

    def config(self) -> WorkloadConfig:
        """A WorkloadConfig that records the trace's shape (summaries carry one per run); the
        trajectories come from the trace, not from a generator."""
        n = len(self.requests)
        reqs = self.requests
        longest = max((r.input_length + self.gen_len(r) for r in reqs), default=2)
        return WorkloadConfig(
            n_trajectories=len(self.sessions), turns_mean=max(1.0, n / max(1, len(self.sessions))),
            append_mean=max(1.0, sum(r.input_length for r in reqs) / max(1, n)),
            gen_mean=max(1.0, sum(self.gen_len(r) for r in reqs) / max(1, n)),
            system_prompt_len=0, max_len=max(2, longest), turns_cv=0.0, append_cv=0.0, gen_cv=0.0,
            vocab_size=reqs[0].vocab_size if reqs else DEFAULT_VOCAB, seed=self.spec.seed, name="trace",
            scale_factor=float(self.spec.length_scale), notes=(self.spec.describe(),))

    @cached_property
    def shared_prefixes(self) -> list[tuple[TraceRequest, int]]:
        """(a first turn, its leading full trace blocks) for each prefix that two or more
        sessions' first turns share and could not find stored: offline every such prefix (they
        all start at once), online those whose sharers arrive within CONCURRENT_S emulated
        seconds of one another. The longest each first turn shares; the most shared first, at
        most MAX_WARM."""
        firsts = [self.requests[s[0]] for s in self.sessions]
        starts = [0.0 if self.spec.offline else r.arrival_s / self.spec.time_scale for r in firsts]
        seen: dict[int, list[float]] = {}
        for r, t in zip(firsts, starts):
            for key in _chain(r.full_ids):
                seen.setdefault(key, []).append(t)

        def concurrent(times: list[float]) -> bool:
            ts = sorted(times)
            return any(b - a <= CONCURRENT_S for a, b in zip(ts, ts[1:]))

        shared: dict[int, tuple[int, TraceRequest, int]] = {}  # key -> (sessions, a request, blocks)
        for r in firsts:
            keys = _chain(r.full_ids)
            n = max((j + 1 for j, k in enumerate(keys) if concurrent(seen[k])), default=0)
            if n:
                shared.setdefault(keys[n - 1], (len(seen[keys[n - 1]]), r, n))
        best = sorted(shared.values(), key=lambda x: (-x[0], x[1].index))[:MAX_WARM]
        return [(r, n) for _, r, n in best]

    def warm_prompts(self, block_size: int) -> tuple[tuple[int, ...], ...]:
        """The shared prefixes (`shared_prefixes`); where there is none, one Full Block no trace
        prompt shares."""
        out = tuple(r.tokens()[:n * r.block_tokens] for r, n in self.shared_prefixes)
        if out:
            return out
        vocab = self.requests[0].vocab_size if self.requests else DEFAULT_VOCAB
        rng = np.random.default_rng([self.spec.seed, _TAG_WARM])
        return (tuple(rng.integers(RESERVED_TOKENS, vocab, size=block_size).tolist()),)

    def warm_keys(self, block_size: int) -> list[tuple[int, ...]]:
        """`block_keys` of what the warm-up persists that a trace prompt can hit."""
        return [block_keys(r, block_size)[:n * r.block_tokens // block_size] for r, n in self.shared_prefixes]


def load_trace(spec: TraceSpec, run_block: int, vocab_size: int = DEFAULT_VOCAB) -> TraceWorkload:
    """Read, select and chain a trace. TraceError (one line) for a bad file; ValueError (one
    line) for a spec that cannot run or a selection with no request."""
    spec.check(run_block)
    reqs = load_mooncake(spec.path, scale=spec.length_scale, vocab_size=vocab_size, salt=spec.seed,
                         max_requests=spec.limit if spec.window is None else None)
    if not reqs:
        raise TraceError(spec.path, None, None, "holds no request")
    chosen = select(reqs, spec)
    if not chosen:
        last = max(r.arrival_s for r in reqs)
        raise TraceError(spec.path, None, None, f"no request in the window {spec.window[0]:g}:{spec.window[1]:g} s "
                         f"(its requests arrive from {min(r.arrival_s for r in reqs):g} to {last:g} s)")
    sessions = chain_sessions(chosen)
    if spec.agents is not None:
        sessions = sessions[:spec.agents]
        keep = sorted(i for s in sessions for i in s)
        where = {i: n for n, i in enumerate(keep)}
        chosen = [chosen[i] for i in keep]
        sessions = [[where[i] for i in s] for s in sessions]
    return TraceWorkload(spec, tuple(chosen), tuple(tuple(s) for s in sessions), trace_block_hit_rate(chosen))


def with_run_hits(stats: dict, per_mode: dict[str, tuple[int, int]]) -> dict:
    """The summary's `trace` object: `stats` (TraceWorkload.stats) and the run's own hit rate,
    from per mode (hit tokens, prompt tokens) of its completed trace requests: `run_hit_rate`
    pooled over the modes (each replays the same trace), and per mode."""
    hit = sum(h for h, _ in per_mode.values())
    total = sum(p for _, p in per_mode.values())
    return {**stats, "run_hit_rate": round(hit / total, 6) if total else None,
            "run_hit_rate_by_mode": {m: round(h / p, 6) if p else None for m, (h, p) in per_mode.items()},
            "run_minus_trace": round(hit / total - stats["trace_block_hit_rate"], 6) if total else None}
