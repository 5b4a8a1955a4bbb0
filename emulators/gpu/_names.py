"""One-line lookup errors shared by the catalogs."""
from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

V = TypeVar("V")


class UnknownName(KeyError):
    """A catalog miss. A KeyError (so `except KeyError` still works) whose message is one plain
    line naming the bad name and the valid ones (KeyError's own str() would quote it)."""

    def __str__(self) -> str:
        return str(self.args[0])


def lookup(catalog: Mapping[str, V], kind: str, name: str) -> V:
    try:
        return catalog[name]
    except (KeyError, TypeError):
        raise UnknownName(f"unknown {kind} {name!r}; valid: {', '.join(sorted(catalog))}") from None
