"""Where the repository's built models live (build/checkpoints), for every module that builds one."""
from __future__ import annotations

from pathlib import Path


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def checkpoints_dir() -> Path:
    """Where named models are built: <repo>/build/checkpoints."""
    return repo_root() / "build" / "checkpoints"
