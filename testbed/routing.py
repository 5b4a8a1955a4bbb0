"""Who serves a request and which side reads its hit KV: the conductor asks a router.

- RoundRobinRouter: no scheduler. Engines in turn, and read paths in turn: the PE side
  only for basic and layerwise, nothing for oracle, both sides alternately for the
  dualpath-rr ablation (the paper's naive dual-path baseline).
- The scheduler service (dualpath, dualpath-split) is testbed.scheduling.ServiceRouter:
  engine group leaders pull the decisions from it.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from dualpath.scheduler.records import Request


@dataclass(frozen=True)
class Route:
    pe: str
    de: str
    path: str  # "pe", "de", "split" or "none"
    pe_blocks: int  # hit blocks read on the PE side; the rest on the DE side


class Router:
    """The conductor's questions and the events it reports; every hook is a no-op here."""

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def stats(self) -> dict:
        """What the run's summary records about the decisions (after stop)."""
        return {}

    async def route(self, req: Request, n_hit_blocks: int, timeout_s: float) -> Route | None:
        """The request's engines and path; None if no engine admitted it within timeout_s."""
        raise NotImplementedError

    def read_started(self, node: str, nbytes: int) -> None:
        pass

    def read_done(self, node: str, nbytes: int) -> None:
        pass

    def prefill_done(self, pe: str, req: Request) -> None:
        pass

    def decode_done(self, de: str, req: Request) -> None:
        pass


def whole(path: str, pe: str, de: str, n_hit_blocks: int) -> Route:
    return Route(pe, de, path, n_hit_blocks if path in ("pe", "none") else 0)


class RoundRobinRouter(Router):
    """Engines in turn, and `paths` in turn ("pe", "de" or "none")."""

    def __init__(self, prefill: list[str], decode: list[str], paths: tuple[str, ...]):
        self._pe, self._de, self._path = itertools.cycle(prefill), itertools.cycle(decode), itertools.cycle(paths)

    async def route(self, req: Request, n_hit_blocks: int, timeout_s: float) -> Route:
        return whole(next(self._path), next(self._pe), next(self._de), n_hit_blocks)
