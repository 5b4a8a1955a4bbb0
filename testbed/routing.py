"""Who serves a request and which side reads its hit KV: the conductor asks a router.

- RoundRobinRouter: no scheduler. Engines in turn; the read path fixed by the mode
  (basic and layerwise read on the PE side, oracle reads nothing).
- PolicyRouter: the round-robin ablation (dualpath-rr), engines and paths in turn, from
  dualpath.scheduler.live.LivePolicy.
- The scheduler service (dualpath, dualpath-split) is testbed.scheduling.ServiceRouter:
  engine group leaders pull the decisions from it.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass

from dualpath.scheduler.records import ReadPath, Request


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
    """basic, layerwise, oracle: engines in turn, one fixed read path."""

    def __init__(self, prefill: list[str], decode: list[str], path: str):
        self._pe, self._de, self.path = itertools.cycle(prefill), itertools.cycle(decode), path

    async def route(self, req: Request, n_hit_blocks: int, timeout_s: float) -> Route:
        return whole(self.path, next(self._pe), next(self._de), n_hit_blocks)


class PolicyRouter(Router):
    """A LivePolicy kept current by the conductor's own events (the dualpath-rr baseline)."""

    def __init__(self, policy) -> None:  # a dualpath.scheduler.live.LivePolicy
        self.policy = policy

    async def route(self, req: Request, n_hit_blocks: int, timeout_s: float) -> Route | None:
        deadline = time.monotonic() + timeout_s
        while (choice := self.policy.choose(req)) is None:  # every PE overloaded: wait (FIFO)
            if time.monotonic() > deadline:
                return None
            await asyncio.sleep(0.005)
        pe, de, path = choice
        return whole("pe" if path is ReadPath.PE else "de", pe, de, n_hit_blocks)

    def read_started(self, node: str, nbytes: int) -> None:
        self.policy.read_queued(node, nbytes)

    def read_done(self, node: str, nbytes: int) -> None:
        self.policy.read_done(node, nbytes)

    def prefill_done(self, pe: str, req: Request) -> None:
        self.policy.prefill_done(pe, req)

    def decode_done(self, de: str, req: Request) -> None:
        self.policy.decode_done(de, req)
