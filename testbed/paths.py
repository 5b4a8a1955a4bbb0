"""Where the repository is, and how results name paths inside it."""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def shown_path(path: str | Path) -> str:
    """A path as a result records it: relative to the repository when inside it, so a committed
    result names no machine's folders; anything else as given."""
    p = Path(path).resolve()
    return str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(path)
