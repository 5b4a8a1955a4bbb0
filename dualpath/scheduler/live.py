"""The scheduler's policies applied request by request, from state the caller keeps current.

The conductor of a live run (and a simulator) tells it when reads start and
end and when prefills finish; it answers, per arriving request, which PE, which
DE and which read path (Algorithm 1, DE phase 2 with Z, shorter read queue).
A round-robin variant makes the ablation's baseline.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence

from .de_assign import compute_z, pick_de
from .pe_assign import assign_pe
from .read_path import shorter_queue
from .records import EngineState, NodeState, ReadPath, Request, Role
from .thresholds import Profile, Thresholds


class LivePolicy:
    """Engine and read-path choice over live state. `policy`: "scheduled" or "rr"."""

    def __init__(self, prefill: Sequence[tuple[str, str]], decode: Sequence[tuple[str, str]],
                 profile: Profile, hbm_tokens: int, policy: str = "scheduled"):
        if policy not in ("scheduled", "rr"):
            raise ValueError(f"unknown policy {policy!r}")
        self.policy = policy
        self.th = Thresholds.from_profile(profile)
        self.nodes: dict[str, NodeState] = {}
        self.engines: dict[str, EngineState] = {}
        for role, pairs in ((Role.PREFILL, prefill), (Role.DECODE, decode)):
            for engine, node in pairs:
                ns = self.nodes.setdefault(node, NodeState(node))
                self.engines[engine] = EngineState(engine, ns, node, role, len(self.engines),
                                                   free_hbm=hbm_tokens)
        self._pe = [e for e in self.engines.values() if e.role is Role.PREFILL]
        self._de = [e for e in self.engines.values() if e.role is Role.DECODE]
        self._rr_pe = itertools.cycle(self._pe)
        self._rr_de = itertools.cycle(self._de)
        self._rr_path = itertools.cycle((ReadPath.PE, ReadPath.DE))

    def choose(self, req: Request) -> tuple[str, str, ReadPath] | None:
        """(PE, DE, path) for the request, or None when every PE is overloaded (it must wait)."""
        if self.policy == "rr":
            pe, de = next(self._rr_pe), next(self._rr_de)
            pe.tok += req.total_len
            de.tok += req.total_len
            return pe.engine_id, de.engine_id, next(self._rr_path)
        got = assign_pe([req], self._pe, self.th)
        if not got:
            return None
        pe = got[0][1]
        de = pick_de(req.total_len, self._de, compute_z(req.total_len, self._de))
        if de is None:  # no DE has HBM for it now: undo and wait
            pe.tok -= req.total_len
            pe.seq -= 1
            return None
        de.tok += req.total_len
        de.seq += 1
        de.free_hbm -= req.total_len
        path = shorter_queue(pe.node.read_q, de.node.read_q)
        return pe.engine_id, de.engine_id, path

    # -- events from the run -------------------------------------------------------------------
    def read_queued(self, node: str, nbytes: int) -> None:
        self.nodes[node].read_q += nbytes

    def read_done(self, node: str, nbytes: int) -> None:
        self.nodes[node].read_q -= nbytes

    def prefill_done(self, engine: str, req: Request) -> None:
        e = self.engines[engine]
        e.tok -= req.total_len
        e.seq = max(0, e.seq - 1)

    def decode_done(self, engine: str, req: Request) -> None:
        e = self.engines[engine]
        e.tok -= req.total_len
        e.seq = max(0, e.seq - 1)
        if self.policy == "scheduled":
            e.free_hbm += req.total_len
