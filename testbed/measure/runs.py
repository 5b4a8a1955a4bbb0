"""Read one run folder (what `dualpath run` writes) for the reproduction analyses.

A run folder holds
  summary.json   top: target, dilation, time, topology, ...; modes.<mode>: faithful,
                 unfaithful_reasons, jct_s (emulated), jct_testbed_s, ttft_s/ttst_s/tpot_s, ...
  records.jsonl  one line per request: mode, trajectory, turn, path, t_arrive ... t_done and
                 token_times (testbed s since the mode's start), ttft_s/ttst_s/tpot_s (emulated)
  passes.jsonl   every prefill pass: mode, pe, t_start, t_end (testbed s), n, loaded, attention_s
                 (emulated), timing{...}
  steps.jsonl    every decode step: mode, de, t_start, t_end, n, timing fields
  links.jsonl    monitor samples 0.25 s apart: mode, t, cpu_busy, nics {"dpt-p0/snic": [rx, tx]}
  plan.json      (written by testbed.reproduce.execute) which reproduction config made it
A committed run keeps its jsonl files gzip-compressed (NAME.jsonl.gz); they read the same.
Times in the jsonl files are testbed seconds; `Run.emulated()` divides by the dilation. Every
analysis reads runs through this module only. Files that are absent read as empty lists.
"""
from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable


class RunError(ValueError):
    """A folder that is not a readable run folder; one line naming the folder and the problem."""


def _jsonl(path: Path) -> list[dict]:
    """The records of a .jsonl file, or of its gzip-compressed copy (`NAME.jsonl.gz`: how the
    repository keeps the runs its reports use)."""
    gz = path.with_name(path.name + ".gz")
    if not path.exists() and not gz.exists():
        return []
    out = []
    with (open(path) if path.exists() else gzip.open(gz, "rt")) as f:
        for i, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise RunError(f"{path}:{i}: not JSON ({e.msg})") from None
    return out


def _by_mode(rows: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in rows:
        out.setdefault(r.get("mode", ""), []).append(r)
    return out


@dataclass
class Run:
    """One run folder, read lazily: the summary at once, each jsonl file on first use."""

    path: Path
    summary: dict[str, Any]
    plan: dict[str, Any] | None = None
    _cache: dict[str, dict[str, list[dict]]] = field(default_factory=dict, repr=False)

    # -- the summary ------------------------------------------------------------------------
    @property
    def dilation(self) -> float:
        """Testbed seconds per emulated second (1 on the host's own clock)."""
        k = self.summary.get("dilation") or self.summary.get("time", {}).get("dilation") or 1.0
        return float(k)

    @property
    def topology(self) -> str:
        return str(self.summary.get("topology", ""))

    @property
    def key(self) -> str | None:
        """The reproduction config this run was made for (plan.json), if any."""
        return (self.plan or {}).get("key")

    @property
    def modes(self) -> list[str]:
        return list(self.summary.get("modes", {}))

    def mode(self, name: str) -> dict[str, Any]:
        try:
            return self.summary["modes"][name]
        except KeyError:
            raise RunError(f"{self.path}: no mode {name!r} in summary.json (it has {', '.join(self.modes) or 'none'})") from None

    def has(self, name: str) -> bool:
        return name in self.summary.get("modes", {})

    def faithful(self, modes: Iterable[str] | None = None) -> bool:
        """True only if every named mode (default: all of the run's) was FAITHFUL and finished
        every request: a JCT over the requests that happened to succeed is no result."""
        names = list(self.modes if modes is None else modes)
        return bool(names) and not self.unfaithful(names)

    def unfaithful(self, modes: Iterable[str] | None = None) -> dict[str, list[str]]:
        """Mode -> reasons, for the named modes that were not FAITHFUL or lost requests."""
        out = {}
        for m in (self.modes if modes is None else modes):
            s = self.summary.get("modes", {}).get(m)
            if s is None:
                out[m] = ["mode missing from the run"]
                continue
            why = [] if s.get("faithful") else list(s.get("unfaithful_reasons") or ["not FAITHFUL"])
            if s.get("errors"):
                first = (s.get("first_error") or {}).get("error", "")
                why.append(f"{s['errors']} of {s.get('requests')} requests failed" + (f" (first: {first})" if first else ""))
            if why:
                out[m] = why
        return out

    def jct(self, mode: str) -> float:
        """Emulated JCT of a mode (s)."""
        return float(self.mode(mode)["jct_s"])

    @property
    def aps(self) -> float | None:
        """Agents per emulated second this run was offered (online runs), from summary.json's
        `arrivals.aps` (or top-level `aps`); None for an offline run."""
        arr = self.summary.get("arrivals")
        if isinstance(arr, dict) and arr.get("aps") is not None:
            return float(arr["aps"])
        if self.summary.get("aps") is not None:
            return float(self.summary["aps"])
        if self.plan and (self.plan.get("config") or {}).get("online"):
            return float(self.plan["config"]["online"]["aps"])
        return None

    # -- the time series ----------------------------------------------------------------------
    def _rows(self, name: str) -> dict[str, list[dict]]:
        if name not in self._cache:
            self._cache[name] = _by_mode(_jsonl(self.path / f"{name}.jsonl"))
        return self._cache[name]

    def records(self, mode: str) -> list[dict]:
        """Every request of a mode (records.jsonl), in file order."""
        return self._rows("records").get(mode, [])

    def passes(self, mode: str) -> list[dict]:
        return self._rows("passes").get(mode, [])

    def steps(self, mode: str) -> list[dict]:
        return self._rows("steps").get(mode, [])

    def links(self, mode: str) -> list[dict]:
        """The monitor's samples of a mode, by time."""
        return sorted(self._rows("links").get(mode, []), key=lambda s: s["t"])

    def agent_spans_s(self, mode: str) -> dict[Any, tuple[float, float]]:
        """Per agent (trajectory), when its first turn arrived and its last turn finished (emulated
        s since the mode's start): the units a JCT (the last finish) and an agent's JCT are made
        of. Failed requests count as not finished; the warm-up request (trajectory < 0) is no agent."""
        out: dict[Any, list[float]] = {}
        for r in self.records(mode):
            if r.get("error") or r.get("t_done") is None or (r.get("trajectory") or 0) < 0:
                continue
            a = out.setdefault(r["trajectory"], [float(r["t_arrive"]), float(r["t_done"])])
            a[0], a[1] = min(a[0], float(r["t_arrive"])), max(a[1], float(r["t_done"]))
        return {k: (self.emulated(a), self.emulated(d)) for k, (a, d) in out.items()}

    def emulated(self, testbed_s: float) -> float:
        return testbed_s / self.dilation

    def snic_rates_bps(self, mode: str) -> dict[str, float]:
        """Configured wire rate of each storage NIC (from the fidelity verdict's link list)."""
        nics = self.mode(mode).get("fidelity", {}).get("storage_nics", [])
        return {n["nic"]: float(n["rate_bps"]) for n in nics if "nic" in n and "rate_bps" in n}


def load_run(path: str | Path) -> Run:
    p = Path(path)
    s = p / "summary.json"
    if not s.exists():
        raise RunError(f"{p}: not a run folder (no summary.json)")
    try:
        summary = json.loads(s.read_text())
    except json.JSONDecodeError as e:
        raise RunError(f"{s}: not JSON ({e.msg})") from None
    if not isinstance(summary.get("modes"), dict):
        raise RunError(f"{s}: has no 'modes' mapping; is it a `dualpath run` folder?")
    plan = None
    if (p / "plan.json").exists():
        plan = json.loads((p / "plan.json").read_text())
    return Run(p, summary, plan)


def find_runs(paths: Iterable[str | Path]) -> list[Run]:
    """Run folders at these paths: each path is a run folder, or a folder whose subfolders
    (to two levels, e.g. a reproduction's runs/) are run folders."""
    out, seen = [], set()
    for raw in paths:
        p = Path(raw)
        cands = [p] if _is_run(p) else sorted(q for q in [*p.glob("*"), *p.glob("*/*")] if _is_run(q))
        if not cands:
            raise RunError(f"{p}: no run folder there (none with a summary.json of modes)")
        for q in cands:
            if q.resolve() not in seen:
                seen.add(q.resolve())
                out.append(load_run(q))
    return out


def _is_run(p: Path) -> bool:
    s = p / "summary.json"
    if not s.is_file():
        return False
    try:
        return isinstance(json.loads(s.read_text()).get("modes"), dict)
    except (json.JSONDecodeError, OSError):
        return False


def write_plan(run_dir: Path, plan: dict[str, Any]) -> None:
    (Path(run_dir) / "plan.json").write_text(json.dumps(plan, indent=2) + "\n")


KEPT_FILES = ("summary.json", "plan.json", "report.md")  # copied as they are; every *.jsonl is gzipped


def archive_run(run: Run, dest_root: Path) -> Run:
    """A compact copy of a run folder under dest_root/<its folder name>: summary, plan and report
    as they are, each .jsonl gzip-compressed (what the repository keeps for the runs its reports
    use; `_jsonl` reads them the same). An existing copy is replaced."""
    import shutil

    src, dest = Path(run.path), Path(dest_root) / Path(run.path).name
    if src.resolve() == dest.resolve():
        return run
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        if f.name in KEPT_FILES:
            shutil.copy2(f, dest / f.name)
        elif f.name.endswith(".jsonl"):
            with open(f, "rb") as a, gzip.open(dest / (f.name + ".gz"), "wb", compresslevel=9) as b:
                shutil.copyfileobj(a, b)
        elif f.name.endswith(".jsonl.gz"):
            shutil.copy2(f, dest / f.name)
    return load_run(dest)

