#!/usr/bin/env python3
"""Keep a run folder in the repository, compactly: `scripts/keep_run.py RUN DEST`.

Copies summary.json, report.md and plan.json (and any PNG) of the run folder RUN to DEST, and every
`*.jsonl` gzip-compressed (`NAME.jsonl.gz`, which testbed.measure.runs reads like the plain file),
so a committed report can link the runs it used by a path that exists in the repository. Refuses a
folder that is not a run, and a DEST that exists (a kept run is not overwritten by another).
"""
from __future__ import annotations

import gzip
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from testbed.measure.runs import _is_run  # noqa: E402

KEEP = ("summary.json", "report.md", "plan.json")


def keep(run: Path, dest: Path) -> list[Path]:
    if not _is_run(run):
        raise SystemExit(f"keep_run: {run} is not a run folder (no summary.json with modes)")
    if dest.exists():
        raise SystemExit(f"keep_run: {dest} exists; choose another name (kept runs are not overwritten)")
    dest.mkdir(parents=True)
    out = []
    for f in sorted(run.iterdir()):
        if f.name in KEEP or f.suffix == ".png":
            out.append(Path(shutil.copy2(f, dest / f.name)))
        elif f.suffix == ".jsonl":
            with open(f, "rb") as src, gzip.open(dest / (f.name + ".gz"), "wb", compresslevel=9) as dst:
                shutil.copyfileobj(src, dst)
            out.append(dest / (f.name + ".gz"))
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: scripts/keep_run.py RUN_FOLDER DEST_FOLDER")
    for p in keep(Path(sys.argv[1]), Path(sys.argv[2])):
        print(f"{p} ({p.stat().st_size} bytes)")
