"""What every reproduction writes: summary.json, report.md, and the headline rows.

summary.json (the interface the checks read):
  id, title, command, quick, faithful (true only if every run it used was FAITHFUL, in every mode
  it used), complete (every run the plan needs was there), missing {config key: why},
  pngs (paths relative to the folder), headline [{name, testbed, paper, bound, n, ci95, ci_method,
  interval}] with null where there is none (n: the samples behind a measured number; ci95: its 95 %
  interval; interval: what a bracketed search allows), is_result and shortfalls, scale_down,
  runs [{key, path, modes, faithful, unfaithful}], plan, and the id's
  own data (table1: rows; figures: the series they plot).
report.md: the producing command, the scale-down, the verdict, a table of every headline number
(testbed, paper, bound side by side), notes, the runs used and the figures.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from testbed.measure.metrics import MIN_LOADED  # noqa: F401  (the ids read it from here)
from testbed.measure.runs import Run
from testbed.reproduce.plan import SEED_KEY
from testbed.reproduce.spread import NO_INTERVAL, Estimate


@dataclass(frozen=True)
class Headline:
    name: str  # says what and in which unit, e.g. "DualPath speed-up over Basic (x)"
    testbed: float | None
    paper: float | None = None
    bound: float | None = None
    n: int | None = None  # the samples (windows, agents, collectives) behind a measured number
    ci95: tuple[float, float] | None = None
    ci_method: str | None = None  # how ci95 was computed, in words
    interval: tuple[float, float] | None = None  # what a bracketed search allows (not a confidence interval)
    simulated: bool = False  # the value is the simulator's: the summary puts it under "simulated", never "testbed"

    def to_dict(self) -> dict[str, Any]:
        ci = [_num(self.ci95[0]), _num(self.ci95[1])] if self.ci95 else None
        value = {"testbed": None, "simulated": _num(self.testbed)} if self.simulated else {"testbed": _num(self.testbed)}
        return {"name": self.name, **value, "paper": _num(self.paper), "bound": _num(self.bound),
                "n": self.n, "ci95": ci, "ci_method": self.ci_method if ci or self.says_why_no_interval else None,
                "interval": [_num(self.interval[0]), _num(self.interval[1])] if self.interval else None}

    def value_text(self) -> str:
        """The value as the report's table shows it: a simulated one says so."""
        return f"{fmt(self.testbed)} (simulated)" if self.simulated and self.testbed is not None else fmt(self.testbed)

    @property
    def says_why_no_interval(self) -> bool:
        """It has no interval, and its method says why (spread.NO_INTERVAL)."""
        return not self.ci95 and (self.ci_method or "").startswith(NO_INTERVAL)

    @classmethod
    def of(cls, name: str, est: Estimate | None, paper: float | None = None, bound: float | None = None) -> "Headline":
        """A measured headline from its estimate (value, n, interval and how it was computed)."""
        if est is None:
            return cls(name, None, paper, bound)
        return cls(name, est.value, paper, bound, n=est.n or None, ci95=est.ci95, ci_method=est.method)

    def paper_in_words(self) -> str | None:
        """Whether the paper's value lies inside the 95 % interval, as a sentence (None without both)."""
        if self.paper is None or not self.ci95:
            return None
        lo, hi = self.ci95
        return (f"{self.name}: the paper's {fmt(self.paper)} is {where(self.paper, lo, hi)} the testbed's 95 % interval "
                f"[{fmt(lo)}, {fmt(hi)}] (n = {self.n}).")


def where(v: float, lo: float, hi: float) -> str:
    """Where v lies against [lo, hi], in a word: inside, below or above."""
    return "inside" if lo <= v <= hi else "below" if v < lo else "above"


def _num(v: float | None) -> float | None:
    if v is None:
        return None
    v = float(v)
    if math.isnan(v) or math.isinf(v):
        return None
    return round(v, 4)


@dataclass(frozen=True)
class UsedRun:
    """One run folder an analysis read, and the modes it read from it."""

    key: str
    run: Run
    modes: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "path": str(self.run.path), "modes": list(self.modes),
                "faithful": self.run.faithful(self.modes), "unfaithful": self.run.unfaithful(self.modes),
                "code": self.run.summary.get("code")}

    def made_on(self) -> str:
        """The commit the run was made on, as the report names it ("" if the run records none)."""
        c = self.run.summary.get("code")
        return f"{c['commit'][:12]}{' with uncommitted changes' if c.get('dirty') else ''}" if c else ""


@dataclass
class Result:
    """What one id's analysis produced; `write` turns it into the folder's files."""

    id: str
    title: str
    headline: list[Headline]
    pngs: list[str] = field(default_factory=list)
    used: list[UsedRun] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)  # the id's own numbers (rows, series)
    notes: list[str] = field(default_factory=list)
    scale_down: str = ""
    missing: dict[str, str] = field(default_factory=dict)
    no_runs_needed: bool = False  # table1, table2: nothing to be faithful about
    sections: list[str] = field(default_factory=list)  # extra markdown for report.md (e.g. the table itself)
    shortfalls: list[str] = field(default_factory=list)  # why a headline is not a result (e.g. too few windows)

    @property
    def is_result(self) -> bool:
        """FAITHFUL (or needing no run), complete, and every headline on enough samples (DESIGN §9)."""
        return self.faithful is not False and not self.missing and not self.shortfalls

    @property
    def faithful(self) -> bool | None:
        """True only if every run used was FAITHFUL in every mode used (and some run was used);
        None for an id that uses no testbed run (models, generators, the simulator)."""
        if self.no_runs_needed:
            return None
        return bool(self.used) and all(u.run.faithful(u.modes) for u in self.used)

    def summary(self, command: str, quick: bool, plan: dict[str, Any] | None) -> dict[str, Any]:
        return {"id": self.id, "title": self.title, "command": command, "quick": quick,
                "faithful": self.faithful, "complete": not self.missing, "missing": self.missing,
                "is_result": self.is_result, "shortfalls": self.shortfalls,
                "pngs": list(self.pngs), "headline": [h.to_dict() for h in self.headline],
                "scale_down": self.scale_down, "notes": self.notes,
                "runs": [u.to_dict() for u in self.used], "plan": plan, **self.data}

    def write(self, out_dir: Path, command: str, quick: bool, plan: dict[str, Any] | None = None,
              plan_lines: Sequence[str] = ()) -> Path:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        s = self.summary(command, quick, plan)
        (out_dir / "summary.json").write_text(json.dumps(s, indent=2, default=_json_default) + "\n")
        (out_dir / "report.md").write_text("\n".join(self.report_lines(command, plan_lines)) + "\n")
        return out_dir

    def report_lines(self, command: str, plan_lines: Sequence[str] = ()) -> list[str]:
        out = [f"# {self.id}: {self.title}", "", f"Produced by `{command}`.", ""]
        if self.scale_down:
            out += [f"**Scale-down.** {self.scale_down}", ""]
        if self.no_runs_needed:
            out += ["**Verdict.** Computed from models and generators; no testbed run involved.", ""]
        elif self.faithful:
            out += ["**Verdict.** FAITHFUL: every run and mode used kept the target's time.", ""]
        elif not self.used:
            out += ["**Verdict.** No run was available: nothing below is a result.", ""]
        else:
            out += ["**Verdict.** NOT FAITHFUL: the numbers below are not results.", ""]
            for u in self.used:
                for m, reasons in u.run.unfaithful(u.modes).items():
                    out.append(f"- {u.key} / {m}: " + "; ".join(reasons))
            out.append("")
        if self.shortfalls:
            out += ["**Not a result.** The headline rests on too few samples:", ""]
            out += [f"- {x}" for x in self.shortfalls]
            out.append("")
        if self.missing:
            out += ["**Incomplete.** These runs were not available:", ""]
            out += [f"- {k}: {why}" for k, why in self.missing.items()]
            out.append("")
        out += ["## Headline numbers", "", "| quantity | testbed | 95 % interval | n | paper | bound |",
                "| --- | --- | --- | --- | --- | --- |"]
        for h in self.headline:
            ci = (f"[{fmt(h.ci95[0])}, {fmt(h.ci95[1])}]" if h.ci95 else
                  f"bracket [{fmt(h.interval[0])}, {fmt(h.interval[1])}]" if h.interval else "—")
            out.append(f"| {h.name} | {h.value_text()} | {ci} | {h.n if h.n is not None else '—'} | {fmt(h.paper)} "
                       f"| {fmt(h.bound)} |")
        out.append("")
        methods = sorted({h.ci_method for h in self.headline if h.ci95 and h.ci_method})
        words = [w for w in (h.paper_in_words() for h in self.headline) if w] + [
            f"{h.name}: {h.ci_method}" for h in self.headline if h.says_why_no_interval]
        if methods or words:
            out += [f"Intervals: {'; '.join(methods)}." if methods else ""] + [f"- {w}" for w in words] + [""]
        if self.sections:
            out += list(self.sections) + [""]
        if self.notes:
            out += ["## Notes", ""] + [f"- {n}" for n in self.notes] + [""]
        if self.used:
            out += ["## Runs used", ""]
            for u in self.used:
                v = "FAITHFUL" if u.run.faithful(u.modes) else "UNFAITHFUL"
                made = u.made_on()
                out.append(f"- `{u.key}`: {u.run.path} ({', '.join(u.modes)}; {v}"
                           + (f"; made on {made})" if made else "; made before runs recorded their commit)"))
            out.append("")
        if self.pngs:
            out += ["## Figures", ""] + [f"![{p}]({p})" for p in self.pngs] + [""]
        if plan_lines:
            out += ["## The runs this id needs (estimated testbed time)", "", "```"] + list(plan_lines) + ["```", ""]
        return out


def fmt(v: float | None) -> str:
    if v is None:
        return "—"
    v = float(v)
    if abs(v) >= 100:
        return f"{v:,.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    return f"{v:.3g}"


def _json_default(o: Any) -> Any:
    if isinstance(o, Path):
        return str(o)
    if isinstance(o, (set, tuple)):
        return list(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def mean(xs: Iterable[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def median(xs: Iterable[float]) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b:
        return None
    return a / b


def replicas(runs: dict[str, Run], key: str) -> list[tuple[str, Run]]:
    """A run and its repeats on other seeds (Plan.with_seeds) that are present, by seed offset."""
    reps = [(0, key, runs[key])] if key in runs else []
    reps += [(int(k[len(key) + len(SEED_KEY):]), k, r) for k, r in runs.items()
             if k.startswith(key + SEED_KEY) and k[len(key) + len(SEED_KEY):].isdigit()]
    return [(k, r) for _, k, r in sorted(reps, key=lambda x: x[0])]


def pick(runs: dict[str, Run], keys: Sequence[str]) -> dict[str, Run]:
    return {k: runs[k] for k in keys if k in runs}


def jct(run: Run, mode: str) -> float | None:
    """Emulated JCT of a mode, None if the run lacks it."""
    return run.jct(mode) if run.has(mode) else None


def pd_bound(run: Run) -> float | None:
    """The run's bound on DualPath's speed-up over Basic: speedup_bound from its summary
    (the least of (P+D)/P, basic/oracle and the agents' chain bound: testbed.measure.metrics.speedups),
    else (P+D)/P from the topology name (<P>p<D>d...)."""
    for m in run.modes:
        b = run.mode(m).get("speedup_bound")
        if b:
            return float(b)
    import re

    name = run.topology or ((run.plan or {}).get("config") or {}).get("topology", "")
    mt = re.match(r"^(\d+)p(\d+)d", name or "")
    if mt:
        p, d = int(mt.group(1)), int(mt.group(2))
        return (p + d) / p
    return None
