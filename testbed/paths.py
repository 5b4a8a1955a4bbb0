"""Where the repository is, and how results name paths inside it."""
from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def shown_path(path: str | Path) -> str:
    """A path as a result records it: relative to the repository when inside it, so a committed
    result names no machine's folders; anything else as given."""
    p = Path(path).resolve()
    return str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(path)


def code_version(repo: Path = REPO) -> dict[str, Any] | None:
    """The commit a result was made on, and whether tracked files differed from it; None outside
    a git checkout. A reference run made on older code measures another testbed: the simulator's
    calibration once compared runs whose model compute differed by 2x."""
    def git(*args: str) -> str | None:
        try:
            p = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return p.stdout if p.returncode == 0 else None

    head, changed = git("rev-parse", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    if head is None or changed is None:
        return None
    return {"commit": head.strip(), "dirty": bool(changed.strip())}
