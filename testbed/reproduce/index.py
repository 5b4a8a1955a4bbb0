"""results/reproduce/index.md: every id's headline numbers at both sizes, from the reports on disk.

For each id and size (quick, full) the newest report folder (`<root>/<id>/<YYYYMMDD-HHMMSS>/`)
gives one row per headline: the quantity, the testbed's value with its 95 % interval (or a
bracket) and `n`, the paper's, the bound, whether it is a result (FAITHFUL, complete, enough
samples), whether its runs are in the repository, and the wall time its command took (reports made before `wall_s` was recorded say "—").
An id with no report at a size gets one row saying so. Pure: it reads summary.json files only.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterable

from testbed.reproduce.common import fmt

STAMP = re.compile(r"^\d{8}-\d{6}$")


def latest_reports(root: Path, fig_id: str) -> dict[str, tuple[Path, dict[str, Any]]]:
    """{"quick"|"full": (folder, summary)}: the newest report of each size."""
    out: dict[str, tuple[Path, dict[str, Any]]] = {}
    d = Path(root) / fig_id
    for folder in sorted((p for p in d.iterdir() if p.is_dir() and STAMP.match(p.name)) if d.is_dir() else []):
        f = folder / "summary.json"
        if not f.is_file():
            continue
        try:
            s = json.loads(f.read_text())
        except json.JSONDecodeError:
            continue
        out["quick" if s.get("quick") else "full"] = (folder, s)  # sorted by stamp: the newest wins
    return out


def _value(h: dict[str, Any]) -> str:
    v = fmt(h.get("testbed")) if h.get("simulated") is None else f"{fmt(h['simulated'])} (simulated)"
    if h.get("ci95"):
        v += f" [{fmt(h['ci95'][0])}, {fmt(h['ci95'][1])}]"
    elif h.get("interval"):
        v += f" (bracket {fmt(h['interval'][0])} to {fmt(h['interval'][1])})"
    return v


def _verdict(s: dict[str, Any]) -> str:
    if s.get("is_result") is not None:
        ok = s["is_result"]
    else:  # reports from before is_result: FAITHFUL and complete
        ok = bool(s.get("faithful")) and bool(s.get("complete", True))
    why = "" if s.get("faithful") else " (no testbed run)" if s.get("faithful", False) is None else " (not FAITHFUL)"
    return ("yes" if ok else "no") + why


def runs_kept(s: dict[str, Any], repo: Path) -> str:
    """Whether every run the report used is in the repository (the path it names exists)."""
    paths = [r.get("path") for r in s.get("runs") or []]
    if not paths:
        return "—"
    there = sum(bool(p) and (repo / p).exists() for p in paths)
    return "yes" if there == len(paths) else f"no ({len(paths) - there} of {len(paths)} not kept)"


def rows(reports: dict[str, dict], repo: Path = Path(".")) -> list[list[str]]:
    """The table's rows from {id: latest_reports(...)}."""
    out = []
    for fig_id, reps in reports.items():
        runless = [k for k, (_, s) in reps.items() if not s.get("plan") and not s.get("runs")]
        sizes = runless[:1] if runless else ["quick", "full"]  # a table has one size: it runs nothing
        for size in sizes:
            if size not in reps:
                out.append([f"`{fig_id}`", size, "no report yet", "—", "—", "—", "—", "—", "—", "—"])
                continue
            folder, s = reps[size]
            size_txt = "both (runs nothing)" if runless else size
            wall = s.get("wall_s")
            wall_txt = "—" if wall is None else f"{wall / 60:.1f} min"
            if wall is not None and "--runs" in (s.get("command") or ""):
                wall_txt += " (analysis of given runs)"
            link = f"[{folder.name}]({fig_id}/{folder.name}/report.md)"
            kept = runs_kept(s, repo)
            for h in s.get("headline", []) or [{"name": "no headline"}]:
                out.append([f"`{fig_id}` {link}", size_txt, h.get("name", ""), _value(h),
                            "—" if h.get("n") is None else str(h["n"]), fmt(h.get("paper")), fmt(h.get("bound")),
                            _verdict(s), kept, wall_txt])
    return out


def index_markdown(root: Path, ids: Iterable[str], repo: Path = Path(".")) -> str:
    """The index; `repo`: where the reports' run paths are relative to (the checkout)."""
    head = ["# Every table and figure: the headline numbers", "",
            "Made by `dualpath reproduce index` (and at the end of `dualpath reproduce all`) from the newest report "
            "of each id at each size under this folder. testbed: the value with its 95 % interval where it is "
            "measured over samples, or the bracket a search left; n: the samples behind it; result: FAITHFUL, "
            "complete and on enough samples; runs kept: whether the runs the report used are in the repository "
            "(reports made before `--archive` name runs that were not kept); wall: the command's time (— for reports "
            "made before it was recorded; a command that reused runs it had made before counts only what it ran).",
            "", "| id | size | quantity | testbed | n | paper | bound | result | runs kept | wall |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    reports = {i: latest_reports(root, i) for i in ids}
    body = ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in rows(reports, repo)]
    walls = [s.get("wall_s") for reps in reports.values() for _, s in reps.values()]
    known = [w for w in walls if w is not None]
    tail = ["", f"Wall time recorded for {len(known)} of {len(walls)} reports: {sum(known) / 60:.1f} min in all."]
    return "\n".join(head + body + tail) + "\n"


def write_index(root: Path, ids: Iterable[str], repo: Path = Path(".")) -> Path:
    p = Path(root) / "index.md"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(index_markdown(root, ids, repo))
    return p
