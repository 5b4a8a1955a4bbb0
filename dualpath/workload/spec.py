"""One workload vocabulary for `dualpath run`, `dualpath sim` and reproduce's configs.

A run's workload is one of
  * generated (`WorkloadSpec`): `--workload demo` (the README's demo workload) or one of the
    paper's trace sets `32K`, `48K`, `64K` (Table 2) with every length divided by
    `--length-scale` (default PAPER_SCALE: the 64K set's MaxLen becomes 2,048 tokens), with
    `--agents`, `--append-scale` and `--gen-scale`;
  * replayed (`dualpath.workload.trace.TraceSpec`): `--trace FILE`, a Mooncake-format JSONL trace,
    with `--length-scale` (default DEFAULT_TRACE_SCALE; it must divide the trace's 512-token
    block into whole Full Blocks), `--agents` (the first N sessions), `--trace-limit`,
    `--trace-window`, `--offline`, `--time-scale` and `--gen-scale`.
`resolve` turns the command line's options into one of them and refuses, in one line, options
that conflict or do not apply. No option at all: None (the command's own default workload).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .trace import TraceSpec, parse_window
from .trajectories import WorkloadConfig, demo_workload, scaled

PRESETS = ("demo", "32K", "48K", "64K")
PAPER_SCALE = 32  # the paper presets' default length scale: 64K MaxLen -> 2,048 tokens (the demo's)
DEFAULT_TRACE_SCALE = 16  # a trace's default on the testbed: 512-token blocks -> 32 tokens, one Full Block


@dataclass(frozen=True)
class WorkloadSpec:
    """A generated workload. preset "demo" is the README's demo workload; "32K"/"48K"/"64K" are
    the paper's three trace sets (Table 2) with every length divided by `scale`."""

    preset: str = "demo"
    scale: float = 1.0
    agents: int = 24
    turns_scale: float = 1.0  # turn counts divided by this (quick sizes only; stated in reports)
    append_scale: float = 1.0  # each turn's append length times this (fig9 left)
    gen_scale: float = 1.0  # each turn's generation length times this (fig9 right)
    first_turn_tokens: int = 0  # > 0: every first turn appends this many cold tokens
    seed: int = 0

    def config(self) -> WorkloadConfig:
        if self.preset == "demo":
            c = demo_workload(seed=self.seed, n_trajectories=self.agents, first_append_len=self.first_turn_tokens)
        else:
            c = scaled(self.preset, self.scale, n_trajectories=self.agents, seed=self.seed)
            if self.first_turn_tokens:
                c = replace(c, first_append_len=self.first_turn_tokens)
        turns = max(1.0, c.turns_mean / self.turns_scale)
        notes = list(c.notes)
        if self.turns_scale != 1:
            notes.append(f"turn counts divided by {self.turns_scale:g} (quick size)")
        if self.append_scale != 1:
            notes.append(f"appends x{self.append_scale:g}")
        if self.gen_scale != 1:
            notes.append(f"generations x{self.gen_scale:g}")
        return replace(c, turns_mean=turns, turns_min=min(c.turns_min, max(1, int(turns))),
                       append_mean=max(1.0, c.append_mean * self.append_scale),
                       gen_mean=max(1.0, c.gen_mean * self.gen_scale), notes=tuple(notes))

    def describe(self) -> str:
        what = "the demo workload" if self.preset == "demo" else f"paper trace {self.preset}, lengths /{self.scale:g}"
        bits = [what, f"{self.agents} agents"]
        if self.turns_scale != 1:
            bits.append(f"turns /{self.turns_scale:g}")
        if self.append_scale != 1:
            bits.append(f"appends x{self.append_scale:g}")
        if self.gen_scale != 1:
            bits.append(f"generations x{self.gen_scale:g}")
        if self.first_turn_tokens:
            bits.append(f"{self.first_turn_tokens}-token cold first turns")
        return ", ".join(bits)


@dataclass(frozen=True)
class WorkloadOptions:
    """The workload options of a command line, as given (None: not given)."""

    workload: str | None = None
    trace: str | None = None
    length_scale: float | None = None
    append_scale: float | None = None
    gen_scale: float | None = None
    agents: int | None = None
    trace_limit: int | None = None
    trace_window: str | None = None
    offline: bool = False
    time_scale: float | None = None
    seed: int = 0
    first_turn_tokens: int = 0
    aps: float = 0.0

    def given(self) -> bool:
        return any(v not in (None, False) for v in (
            self.workload, self.trace, self.length_scale, self.append_scale, self.gen_scale, self.agents,
            self.trace_limit, self.trace_window, self.offline or None, self.time_scale))


_TRACE_ONLY = (("trace_limit", "--trace-limit"), ("trace_window", "--trace-window"), ("time_scale", "--time-scale"))


def resolve(o: WorkloadOptions, default_trace_scale: int = DEFAULT_TRACE_SCALE) -> WorkloadSpec | TraceSpec | None:
    """The workload the options name (the module docstring); ValueError with one line when they
    conflict or do not apply."""
    if not o.given():
        return None
    if o.trace is not None:
        return _trace(o, default_trace_scale)
    for name, flag in _TRACE_ONLY:
        if getattr(o, name) is not None:
            raise ValueError(f"{flag} applies to a replayed trace; fix: add --trace FILE, or drop {flag}")
    if o.offline:
        raise ValueError("--offline applies to a replayed trace (a generated workload is offline unless --aps "
                         "is given); fix: add --trace FILE, or drop --offline")
    preset = o.workload or "demo"
    if preset not in PRESETS:
        raise ValueError(f"--workload {preset[:40]!r}: choose one of {', '.join(PRESETS)} (or --trace FILE)")
    if preset == "demo" and o.length_scale not in (None, 1):
        raise ValueError("--length-scale applies to the paper presets (32K, 48K, 64K) and to --trace; the demo "
                         "workload has its own lengths; fix: drop it, or choose a preset")
    scale = float(o.length_scale or (PAPER_SCALE if preset != "demo" else 1))
    if not scale > 0:
        raise ValueError(f"--length-scale {o.length_scale}: must be > 0")
    for v, flag in ((o.append_scale, "--append-scale"), (o.gen_scale, "--gen-scale")):
        if v is not None and not v > 0:
            raise ValueError(f"{flag} {v}: must be > 0")
    spec = WorkloadSpec(preset=preset, scale=scale, agents=o.agents or 24, append_scale=o.append_scale or 1.0,
                        gen_scale=o.gen_scale or 1.0, first_turn_tokens=o.first_turn_tokens, seed=o.seed)
    spec.config()  # refuses what cannot generate (e.g. a cold first turn longer than MaxLen), in one line
    return spec


def _trace(o: WorkloadOptions, default_scale: int) -> TraceSpec:
    if o.workload is not None:
        raise ValueError("--trace and --workload name two workloads; fix: give one of them")
    if o.append_scale is not None:
        raise ValueError("--append-scale applies to generated workloads (a trace's prompts are its own); "
                         "fix: drop it")
    if o.first_turn_tokens:
        raise ValueError("--first-turn-tokens applies to generated workloads (a trace's first turns are its "
                         "own); fix: drop it")
    if o.aps:
        raise ValueError("--aps: a trace's agents arrive at its own timestamps; fix: drop --aps (compress the "
                         "trace's clock with --time-scale, or start every agent at once with --offline)")
    if o.offline and o.time_scale is not None:
        raise ValueError("--time-scale and --offline: an offline replay has no clock to scale; fix: give one")
    scale = default_scale if o.length_scale is None else o.length_scale
    if scale != int(scale):
        raise ValueError(f"--length-scale {scale}: a trace's scale must be a whole number dividing 512")
    return TraceSpec(path=o.trace, length_scale=int(scale), limit=o.trace_limit,
                     window=parse_window(o.trace_window) if o.trace_window is not None else None,
                     agents=o.agents, offline=o.offline, time_scale=1.0 if o.time_scale is None else o.time_scale,
                     gen_scale=1.0 if o.gen_scale is None else o.gen_scale, seed=o.seed)


def describe_scale(spec: WorkloadSpec | TraceSpec, run_block: int) -> str:
    """The line a run prints about its length scale and block sizes."""
    if isinstance(spec, TraceSpec):
        b = spec.block_tokens()
        per = f"{b // run_block} of the run's" if b >= run_block else f"1/{run_block // b} of the run's"
        return (f"length scale {spec.length_scale}: a 512-token trace block is {b} tokens here ({per} {run_block}-token "
                f"Full Blocks)" + ("" if b >= run_block else "; hits count whole Full Blocks only, so the run hits "
                                                              "less than the trace's prefixes allow"))
    if spec.preset == "demo":
        return f"the demo workload at its own lengths; the run's Full Block is {run_block} tokens"
    max_len = int(spec.preset[:-1]) * 1024
    return (f"length scale {spec.scale:g}: the {spec.preset} set's MaxLen {max_len} is {max_len / spec.scale:.0f} "
            f"tokens here, the paper's 64-token Full Block {64 / spec.scale:g}; the run's Full Block is {run_block} tokens")
