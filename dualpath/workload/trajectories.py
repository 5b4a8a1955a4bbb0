"""Agentic multi-turn trajectories: a seeded generator, the paper's trace statistics, hit rates.

A trajectory is what one agent does: a system prompt shared by every trajectory of the workload
(so all of them share a KV prefix), then turns. Turn t appends `append` tokens (tool output or user
text) to the context and the model generates `gen_len` tokens. The prompt of turn t is

    system prompt + for each earlier turn i < t: (append_i + the tokens generated in turn i) + append_t

The generated tokens are produced by the model at run time, so the generator fixes only the
appends (token ids) and the generation lengths; `Trajectory.prompt(t, generated)` assembles the
prompt once the earlier generations are known.

Length distributions (documented, all seeded from `WorkloadConfig.seed`):
  * append and gen lengths: `length_dist="lognormal"` (default): X ~ LogNormal(mu, sigma) with
    sigma^2 = ln(1 + cv^2) and mu = ln(mean) - sigma^2 / 2, so E[X] = mean and sd/mean = cv; the
    length is round(X) clipped to >= 1. Rounding is unbiased and the clip moves the mean by far
    less than 1 % for means >= 4. `"geometric"`: support {1, 2, ...}, mean exactly `mean`
    (cv = sqrt(1 - 1/mean), ignores the cv setting). `"fixed"`: always round(mean).
  * turns: turns_min + NegativeBinomial with mean (turns_mean - turns_min) and standard deviation
    turns_cv * turns_mean (Poisson when that spread is below Poisson's; exactly round(turns_mean)
    when turns_cv is 0), so E[turns] = turns_mean before truncation and no trajectory has fewer than turns_min turns before truncation.
  * Truncation at max_len: turn t is kept only if its whole context including its own generation,
    prompt_len(t) + gen_len(t), fits in max_len; the first turn that does not fit ends the
    trajectory (the paper: "truncate the trajectory at the given MaxLen"). Truncation can leave
    fewer than turns_min turns; the first turn is always kept, its append (then gen) shrunk to fit.
  * Token ids: uniform in [RESERVED_TOKENS, vocab_size) (ids 0..3 are reserved for special tokens).

Each trajectory draws from its own stream, `np.random.default_rng([seed, 1 + index])`, and the
system prompt from `[seed, 0]`, so trajectory i is the same whatever n_trajectories is.

Hit rate (see `turn_hits`): the store holds every full block of each earlier context, so what a
turn hits is the full blocks of the previous context whose KV exists.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

RESERVED_TOKENS = 4  # token ids 0..3 are reserved (pad, bos, eos, unk); generated ids start here
DEFAULT_VOCAB = 512  # the tiny model's vocabulary (dualpath/model/tiny.py)
DEFAULT_BLOCK_SIZE = 16  # = dualpath.kv.layouts.DEFAULT_BLOCK_SIZE (not imported: that pulls in torch)
LENGTH_DISTS = ("lognormal", "geometric", "fixed")


# --------------------------------------------------------------------------- data


@dataclass(frozen=True)
class Turn:
    append: tuple[int, ...]  # token ids appended to the context before this turn's prefill
    gen_len: int  # tokens the model generates this turn (>= 1: prefill yields the first one)
    # A replayed trace's turn: its whole prompt, as the trace gives it (a trace knows its own
    # earlier answers, not the replayed model's), instead of context + append.
    prompt: tuple[int, ...] | None = None
    # A replayed trace's turn: the earliest start, seconds after its agent's arrival (the trace's
    # timestamp); it never starts before the previous turn's answer. None: right after it.
    at_s: float | None = None


@dataclass(frozen=True)
class Trajectory:
    id: int
    system_prompt: tuple[int, ...]  # the same object for every trajectory of a workload
    turns: tuple[Turn, ...]
    arrival_s: float | None = None  # set by trace loaders; generated workloads leave it to the run

    @property
    def n_turns(self) -> int:
        return len(self.turns)

    def prompt_len(self, t: int, gen_lens: Sequence[int] | None = None) -> int:
        """Length of turn t's prompt; `gen_lens[i]` overrides turn i's planned gen_len."""
        if self.turns[t].prompt is not None:
            return len(self.turns[t].prompt)
        n = len(self.system_prompt)
        for i in range(t):
            n += len(self.turns[i].append) + (self.turns[i].gen_len if gen_lens is None else gen_lens[i])
        return n + len(self.turns[t].append)

    def final_len(self) -> int:
        """Context length after the last turn's generation (<= max_len of the generator)."""
        if self.turns and self.turns[-1].prompt is not None:
            return len(self.turns[-1].prompt) + self.turns[-1].gen_len
        return len(self.system_prompt) + sum(len(u.append) + u.gen_len for u in self.turns)

    def prompt(self, t: int, generated: Sequence[Sequence[int]]) -> list[int]:
        """Token ids of turn t's prompt, given the tokens actually generated in turns 0..t-1."""
        if self.turns[t].prompt is not None:
            return list(self.turns[t].prompt)
        if len(generated) < t:
            raise ValueError(f"turn {t} needs the generated tokens of {t} earlier turns, got {len(generated)}")
        out = list(self.system_prompt)
        for i in range(t):
            out.extend(self.turns[i].append)
            out.extend(generated[i])
        out.extend(self.turns[t].append)
        return out


@dataclass(frozen=True)
class WorkloadConfig:
    """Everything that determines a generated workload. Lengths are in tokens of *this* run;
    `scale_factor` records by how much they were divided from the source (1 = unscaled)."""

    n_trajectories: int
    turns_mean: float
    append_mean: float
    gen_mean: float
    system_prompt_len: int
    max_len: int
    turns_min: int = 1
    turns_cv: float = 0.5
    append_cv: float = 1.0
    gen_cv: float = 1.0
    length_dist: str = "lognormal"
    # > 0: every first turn appends exactly this many tokens, the agent's own task context,
    # cold in the store (a compute burst as the agents start together)
    first_append_len: int = 0
    vocab_size: int = DEFAULT_VOCAB
    seed: int = 0
    name: str = "custom"
    scale_factor: float = 1.0
    notes: tuple[str, ...] = ()

    def __post_init__(self):
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(f"WorkloadConfig({self.name}): {msg}")

        for f in ("n_trajectories", "system_prompt_len", "max_len", "turns_min", "vocab_size", "seed",
                  "first_append_len"):
            v = getattr(self, f)
            need(isinstance(v, int) and not isinstance(v, bool), f"{f} must be an int, got {v!r}")
        need(self.n_trajectories >= 0, "n_trajectories must be >= 0")
        need(self.system_prompt_len >= 0, "system_prompt_len must be >= 0")
        need(self.first_append_len >= 0, "first_append_len must be >= 0")
        need(self.turns_min >= 1, "turns_min must be >= 1")
        need(self.turns_mean >= self.turns_min, f"turns_mean {self.turns_mean} < turns_min {self.turns_min}")
        need(self.append_mean >= 1 and self.gen_mean >= 1, "append_mean and gen_mean must be >= 1")
        for f in ("turns_cv", "append_cv", "gen_cv"):
            need(getattr(self, f) >= 0, f"{f} must be >= 0")
        need(self.length_dist in LENGTH_DISTS, f"length_dist must be one of {LENGTH_DISTS}")
        need(self.vocab_size > RESERVED_TOKENS, f"vocab_size must be > {RESERVED_TOKENS} (ids 0..3 reserved)")
        need(self.max_len >= self.system_prompt_len + 2,
             f"max_len {self.max_len} leaves no room for one append and one generated token "
             f"after the {self.system_prompt_len}-token system prompt")
        need(self.scale_factor > 0, "scale_factor must be > 0")
        need(self.system_prompt_len + self.first_append_len + 1 < self.max_len,
             f"a first turn of {self.first_append_len} tokens after the {self.system_prompt_len}-token system "
             f"prompt leaves no room for a generated token within max_len {self.max_len}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["notes"] = list(self.notes)
        return d


@dataclass(frozen=True)
class Workload:
    config: WorkloadConfig
    system_prompt: tuple[int, ...]
    trajectories: tuple[Trajectory, ...]
    # Prompts persisted before a mode's first request (a real request each, as the warm-up):
    # empty means the shared system prompt alone. A replayed trace warms the prefixes its agents'
    # first turns share (dualpath.workload.trace).
    warm_prompts: tuple[tuple[int, ...], ...] = ()
    trace: dict | None = None  # a replayed trace's description (dualpath.workload.trace.TraceWorkload)

    def warmups(self) -> tuple[tuple[int, ...], ...]:
        """What the warm-up persists, one request each."""
        return self.warm_prompts or ((self.system_prompt,) if self.system_prompt else ())

    def __len__(self) -> int:
        return len(self.trajectories)

    def __iter__(self) -> Iterator[Trajectory]:
        return iter(self.trajectories)

    def stats(self, block_size: int = DEFAULT_BLOCK_SIZE) -> dict:
        return workload_stats(self.trajectories, block_size)


# --------------------------------------------------------------------------- sampling


def sample_lengths(rng: np.random.Generator, n: int, mean: float, cv: float, dist: str) -> np.ndarray:
    """n lengths >= 1 with the given mean (see the module docstring for each distribution)."""
    if dist == "fixed" or (dist == "lognormal" and cv == 0):
        return np.full(n, max(1, int(round(mean))), dtype=np.int64)
    if dist == "geometric":
        return rng.geometric(1.0 / mean, size=n).astype(np.int64)
    if dist == "lognormal":
        s2 = math.log1p(cv * cv)
        x = rng.lognormal(math.log(mean) - s2 / 2, math.sqrt(s2), size=n)
        return np.maximum(np.rint(x), 1).astype(np.int64)
    raise ValueError(f"unknown length distribution {dist!r}; choose one of {LENGTH_DISTS}")


def sample_turns(rng: np.random.Generator, mean: float, cv: float, minimum: int) -> int:
    """turns_min + NegBin with mean (mean - min) and sd cv * mean (Poisson if narrower)."""
    m = mean - minimum
    if m <= 0 or cv == 0:
        return max(minimum, int(round(mean)))
    var = (cv * mean) ** 2
    if var <= m:
        return minimum + int(rng.poisson(m))
    n = m * m / (var - m)
    return minimum + int(rng.negative_binomial(n, n / (n + m)))


def _tokens(rng: np.random.Generator, n: int, vocab: int) -> tuple[int, ...]:
    return tuple(rng.integers(RESERVED_TOKENS, vocab, size=n).tolist())


def _turn_lengths(c: WorkloadConfig, rng: np.random.Generator) -> list[tuple[int, int]]:
    """One trajectory's (append, gen) lengths after truncation at max_len, drawn from its stream
    before any token id (so the lengths alone come out the same as in `generate`)."""
    n = sample_turns(rng, c.turns_mean, c.turns_cv, c.turns_min)
    apps = sample_lengths(rng, n, c.append_mean, c.append_cv, c.length_dist)
    gens = sample_lengths(rng, n, c.gen_mean, c.gen_cv, c.length_dist)
    out: list[tuple[int, int]] = []
    ctx = c.system_prompt_len
    if c.first_append_len:
        apps[0] = c.first_append_len
    for t in range(n):
        a, g = int(apps[t]), int(gens[t])
        if ctx + a + g > c.max_len:
            if t > 0:
                break
            a = min(a, c.max_len - ctx - 1)  # keep the first turn: shrink it to fit
            g = min(g, c.max_len - ctx - a)
        out.append((a, g))
        ctx += a + g
    return out


def generate(config: WorkloadConfig) -> Workload:
    """The workload a config describes; the same config always gives the same workload."""
    c = config
    system = _tokens(np.random.default_rng([c.seed, 0]), c.system_prompt_len, c.vocab_size)
    trajs = []
    for i in range(c.n_trajectories):
        rng = np.random.default_rng([c.seed, 1 + i])
        turns = [Turn(_tokens(rng, a, c.vocab_size), g) for a, g in _turn_lengths(c, rng)]
        trajs.append(Trajectory(i, system, tuple(turns)))
    return Workload(c, system, tuple(trajs))


def generate_lengths(config: WorkloadConfig) -> list[list[tuple[int, int]]]:
    """Per trajectory, its turns' (append, gen) lengths: exactly those of `generate(config)`,
    without drawing a token id (a simulator of 48K agents needs the lengths only)."""
    return [_turn_lengths(config, np.random.default_rng([config.seed, 1 + i])) for i in range(config.n_trajectories)]


# --------------------------------------------------------------------------- hit rate


@dataclass(frozen=True)
class TurnHit:
    trajectory: int
    turn: int
    prompt_len: int  # tokens in this turn's prompt
    hit: int  # tokens whose KV is read from the store (a multiple of block_size)

    @property
    def miss(self) -> int:
        return self.prompt_len - self.hit


GenTokensFn = Callable[[Trajectory, int], int]


def turn_hits(trajectories: Iterable[Trajectory], block_size: int = DEFAULT_BLOCK_SIZE,
              gen_tokens_fn: GenTokensFn | None = None) -> Iterator[TurnHit]:
    """Hit and prompt tokens of every turn, assuming the store holds every full block it could.

    Exactly:
      * turn 0: hit = floor(S / B) * B, S = system prompt length (the store is warmed with it);
      * turn t >= 1: let C = the full context after turn t-1 (system prompt + every earlier append
        and generation). The last generated token of turn t-1 is sampled but never fed back, so
        its KV was never computed: K = C - 1 tokens have KV. hit = floor(K / B) * B; the tail
        partial block and the last generated token are recomputed with the new append as miss.
      * miss = prompt_len - hit >= append (>= 1), so every turn computes at least one token.
    `gen_tokens_fn(trajectory, i)` gives the tokens actually generated in turn i (e.g. a run that
    stopped early); default: the planned `turns[i].gen_len`. Values < 1 are treated as 1.
    """
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    seen: set[int] = set()  # the full blocks of every explicit prompt so far (a replayed trace's)
    for tr in trajectories:
        S = len(tr.system_prompt)
        ctx = S  # full context before this turn's append
        for t, turn in enumerate(tr.turns):
            if turn.prompt is not None:
                yield TurnHit(tr.id, t, len(turn.prompt), _stored_prefix(turn.prompt, block_size, seen))
                continue
            kv = S if t == 0 else ctx - 1
            hit = (kv // block_size) * block_size
            yield TurnHit(tr.id, t, ctx + len(turn.append), hit)
            g = turn.gen_len if gen_tokens_fn is None else gen_tokens_fn(tr, t)
            ctx += len(turn.append) + max(1, int(g))


def _stored_prefix(prompt: Sequence[int], block_size: int, seen: set[int]) -> int:
    """Tokens of `prompt`'s leading full blocks already in `seen` (chained keys, so a prefix),
    leaving at least one token to compute; adds the prompt's full blocks to `seen`."""
    key, hit, hitting = 0, 0, True
    for j in range(len(prompt) // block_size):
        key = hash((key, tuple(prompt[j * block_size:(j + 1) * block_size])))
        if hitting and key in seen:
            hit += block_size
        else:
            hitting = False
            seen.add(key)
    return min(hit, (len(prompt) - 1) // block_size * block_size)


def hit_rate(trajectories: Iterable[Trajectory], block_size: int = DEFAULT_BLOCK_SIZE,
             gen_tokens_fn: GenTokensFn | None = None) -> float:
    """Token-weighted KV hit rate over all turns: sum(hit) / sum(prompt_len) (see `turn_hits`)."""
    hit = total = 0
    for h in turn_hits(trajectories, block_size, gen_tokens_fn):
        hit += h.hit
        total += h.prompt_len
    return hit / total if total else 0.0


def workload_stats(trajectories: Sequence[Trajectory], block_size: int = DEFAULT_BLOCK_SIZE) -> dict:
    """Summary numbers in the paper's terms (means per turn / per trajectory)."""
    trs = list(trajectories)
    turns = [u for tr in trs for u in tr.turns]
    hits = list(turn_hits(trs, block_size))
    n_turns = len(turns)

    def mean(xs) -> float:
        xs = list(xs)
        return float(sum(xs) / len(xs)) if xs else 0.0

    return {
        "trajectories": len(trs),
        "turns_mean": mean(tr.n_turns for tr in trs),
        "turns_min": min((tr.n_turns for tr in trs), default=0),
        "turns_total": n_turns,
        "append_mean": mean(len(u.append) for u in turns),
        "gen_mean": mean(u.gen_len for u in turns),
        "prompt_len_mean": mean(h.prompt_len for h in hits),  # the paper's "average context"
        "prompt_len_max": max((h.prompt_len for h in hits), default=0),
        "total_len_mean": mean(tr.final_len() for tr in trs),
        "block_size": block_size,
        "hit_rate": hit_rate(trs, block_size),
    }


# --------------------------------------------------------------------------- presets


@dataclass(frozen=True)
class PaperTraceSet:
    """One of the paper's three trace sets (Table 2), in the paper's units. None = not reported
    in the material we have (shared/reference)."""

    name: str
    max_len: int
    n_trajectories: int
    turns_mean: float
    append_mean: float
    gen_mean: float | None
    context_mean: float | None = None  # average prompt ("context") length per turn
    total_len_mean: float | None = None  # average tokens per trajectory at its end
    hit_rate: float | None = None
    source: str = ""


_ZH = "shared/reference/dualpath-article-zh.txt section 1.1 (Table 2)"


def paper_presets() -> dict[str, PaperTraceSet]:
    """The paper's three agentic trace sets (500 trajectories each, code-debugging RL rollouts).

    64K: 157 turns, append 429, gen 176, context 32,721, hit 98.7 % = 32721/(32721+429);
    total_len 55,958 (from the article's Little's-law check, section 5.5). 48K: 106 turns, append
    474. 32K: 60 turns, append 608. Generation lengths of 32K/48K are not in our material.
    Note the 64K numbers are not mutually consistent as plain means: 157 * (429 + 176) = 95 K
    tokens > MaxLen; the per-turn averages are evidently weighted differently from the turn count.
    """
    return {
        "32K": PaperTraceSet("32K", 32 * 1024, 500, 60, 608, None, source=_ZH),
        "48K": PaperTraceSet("48K", 48 * 1024, 500, 106, 474, None, source=_ZH),
        "64K": PaperTraceSet("64K", 64 * 1024, 500, 157, 429, 176, context_mean=32721,
                             total_len_mean=55958, hit_rate=0.987, source=_ZH + " and section 5.5"),
    }


# Assumptions scaled() has to make where the paper is silent (recorded in the config's notes).
ASSUMED_GEN_MEAN = 176  # 32K/48K: use the 64K set's generation length
ASSUMED_SYSTEM_PROMPT = 2048  # paper tokens of shared prefix; not reported
ASSUMED_TURNS_CV = 0.5


def scaled(preset: PaperTraceSet | str, factor: float, *, n_trajectories: int | None = None,
           seed: int = 0, vocab_size: int = DEFAULT_VOCAB,
           system_prompt_len: int | None = None) -> WorkloadConfig:
    """A generator config for a paper trace set with every *length* divided by `factor`.

    Turn counts are counts and stay as they are, so each trajectory has the paper's shape (and,
    with lengths and block size scaled together, about its hit rate) at 1/factor of the tokens.
    `turns_mean` is the paper's mean before truncation at max_len/factor; the paper's 64K figures
    exceed MaxLen as plain means (see paper_presets), so truncation lowers the realised mean.
    """
    p = paper_presets()[preset] if isinstance(preset, str) else preset
    if not factor >= 1:
        raise ValueError(f"scale factor must be >= 1 (lengths are scaled down), got {factor}")
    notes = [f"paper trace set {p.name} ({p.source}), lengths divided by {factor:g}"]
    gen = p.gen_mean
    if gen is None:
        gen = ASSUMED_GEN_MEAN
        notes.append(f"generation length not reported for {p.name}: assumed {ASSUMED_GEN_MEAN} (64K set's)")
    if system_prompt_len is None:
        system_prompt_len = max(0, round(ASSUMED_SYSTEM_PROMPT / factor))
        notes.append(f"shared system prompt not reported: assumed {ASSUMED_SYSTEM_PROMPT} paper tokens")
    notes.append(f"turn-count spread not reported: assumed cv {ASSUMED_TURNS_CV}")
    return WorkloadConfig(
        n_trajectories=p.n_trajectories if n_trajectories is None else n_trajectories,
        turns_mean=float(p.turns_mean),
        append_mean=max(1.0, p.append_mean / factor),
        gen_mean=max(1.0, gen / factor),
        system_prompt_len=system_prompt_len,
        max_len=int(p.max_len // factor),
        turns_min=1,
        turns_cv=ASSUMED_TURNS_CV,
        vocab_size=vocab_size,
        seed=seed,
        name=f"paper-{p.name}/{factor:g}",
        scale_factor=float(factor),
        notes=tuple(notes),
    )


def demo_workload(seed: int = 0, **overrides) -> WorkloadConfig:
    """The end-to-end demo: 24 trajectories of 8 to 12 turns (10 on average) over a shared 512-token
    system prompt, appends ~24 and generations ~6 tokens, vocab 512, max_len 2048.

    Shaped like the paper's traces where it matters for I/O: each turn reads back a context two
    orders of magnitude longer than what it generates (the 64K set: 32,721 context tokens per
    turn against 176 generated, 186:1; here about 700:6) and appends little (hit rate about 0.95
    with 16-token blocks, 0.93 with the runs' 32). The lengths are scaled down so that a run of
    every mode finishes in minutes on two cores."""
    base = dict(n_trajectories=24, turns_mean=10.0, turns_min=8, turns_cv=0.1, append_mean=24.0,
                append_cv=0.5, gen_mean=6.0, gen_cv=0.3, system_prompt_len=512, max_len=2048, vocab_size=512, seed=seed,
                name="demo", notes=("sized for the 1p1d-io e2e demo on a 2-core machine",))
    base.update(overrides)
    return WorkloadConfig(**base)


def poisson_arrivals(n: int, aps: float, seed: int = 0) -> list[float]:
    """Arrival times (s, first at 0) of n agents arriving as a Poisson process at `aps` per second."""
    if aps <= 0:
        raise ValueError("aps must be > 0")
    if n <= 0:
        return []
    gaps = np.random.default_rng([seed, 0x41505300]).exponential(1.0 / aps, size=n - 1)
    return [0.0] + np.cumsum(gaps).tolist()


def with_arrivals(trajectories: Sequence[Trajectory], arrivals: Sequence[float]) -> list[Trajectory]:
    if len(arrivals) != len(trajectories):
        raise ValueError(f"{len(arrivals)} arrival times for {len(trajectories)} trajectories")
    return [replace(tr, arrival_s=float(a)) for tr, a in zip(trajectories, arrivals)]
