"""Read-path choice: which node's SNIC reads a request's hit KV.

The paper's rule reads from the side whose node has the shorter read queue (bytes). Round-robin is
the ablation's naive choice. Split is ours: it divides one request's hit blocks so that both SNICs
finish their queues at the same time, which a whole-request choice cannot do when one request is
large compared with the queues.
"""
from __future__ import annotations

import math
from typing import Protocol

from .records import NodeState, PathDecision, ReadPath


def shorter_queue(pe_read_q: float, de_read_q: float, pe_read_total: float = 0, de_read_total: float = 0) -> ReadPath:
    """The paper's rule. Equal queues (in a cluster that is not I/O-bound, mostly both empty)
    go to the side that was given fewer bytes to read so far, then to the PE side: always
    the PE side would load its SNIC alone whenever reads keep up."""
    if de_read_q != pe_read_q:
        return ReadPath.DE if de_read_q < pe_read_q else ReadPath.PE
    return ReadPath.DE if de_read_total < pe_read_total else ReadPath.PE


def finish_times(
    pe_blocks: int, n_blocks: int, block_bytes: float,
    pe_read_q: float, de_read_q: float, pe_bw: float, de_bw: float,
) -> tuple[float, float]:
    """Seconds until each side has drained its queue plus its share of this request."""
    return (
        (pe_read_q + pe_blocks * block_bytes) / pe_bw,
        (de_read_q + (n_blocks - pe_blocks) * block_bytes) / de_bw,
    )


def split_blocks(
    n_blocks: int, block_bytes: float,
    pe_read_q: float, de_read_q: float, pe_bw: float, de_bw: float,
) -> tuple[int, int]:
    """Blocks (pe, de) that minimise the later of the two finishing times.

    Finishing times are linear in x = PE blocks, one rising and one falling, so the best integer
    split sits next to where they cross:
        (q_p + x b)/bw_p = (q_d + (n - x) b)/bw_d
        x* = (bw_p (q_d + n b) - bw_d q_p) / (b (bw_p + bw_d))
    With empty queues this is x/n = bw_p/(bw_p + bw_d): shares in proportion to drain rates.
    """
    if n_blocks < 0 or block_bytes < 0:
        raise ValueError("n_blocks and block_bytes must be >= 0")
    if pe_bw <= 0 or de_bw <= 0:
        raise ValueError("drain bandwidths must be > 0")
    if n_blocks == 0 or block_bytes == 0:
        return n_blocks, 0  # nothing to balance: same tie rule as shorter_queue
    x_star = (pe_bw * (de_read_q + n_blocks * block_bytes) - de_bw * pe_read_q) / (block_bytes * (pe_bw + de_bw))
    best_x = -1
    best_t = math.inf
    for x in (math.floor(x_star), math.ceil(x_star)):
        x = min(max(x, 0), n_blocks)
        t = max(finish_times(x, n_blocks, block_bytes, pe_read_q, de_read_q, pe_bw, de_bw))
        if t < best_t or (t == best_t and x > best_x):
            best_x, best_t = x, t
    return best_x, n_blocks - best_x


class PathPolicy(Protocol):
    name: str

    def decide(
        self, n_blocks: int, block_bytes: float, pe_node: NodeState, de_node: NodeState
    ) -> PathDecision: ...


def avoid_down(d: PathDecision, pe_node: NodeState, de_node: NodeState) -> tuple[PathDecision, str]:
    """The second path as fault tolerance: a decision that would read on a node whose SNIC is
    down moves wholly to the other side when that one is up. Returns the decision and the node
    it avoided ("" when nothing moved: both up, both down, or nothing to read)."""
    n = d.pe_blocks + d.de_blocks
    if n == 0 or pe_node.snic_up == de_node.snic_up:
        return d, ""
    if not pe_node.snic_up and d.pe_blocks:
        return PathDecision(ReadPath.DE, 0, n), pe_node.node_id
    if not de_node.snic_up and d.de_blocks:
        return PathDecision(ReadPath.PE, n, 0), de_node.node_id
    return d, ""


def _whole(path: ReadPath, n_blocks: int) -> PathDecision:
    return PathDecision(path, n_blocks, 0) if path is ReadPath.PE else PathDecision(path, 0, n_blocks)


class ShorterQueue:
    """dualpath: the paper's rule."""

    name = "shorter"

    def decide(self, n_blocks: int, block_bytes: float, pe_node: NodeState, de_node: NodeState) -> PathDecision:
        return _whole(shorter_queue(pe_node.read_q, de_node.read_q, pe_node.read_total, de_node.read_total), n_blocks)


class RoundRobin:
    """dualpath-rr: alternate sides regardless of load (the ablation's naive choice)."""

    name = "rr"

    def __init__(self) -> None:
        self._next_de = False

    def decide(self, n_blocks: int, block_bytes: float, pe_node: NodeState, de_node: NodeState) -> PathDecision:
        path = ReadPath.DE if self._next_de else ReadPath.PE
        self._next_de = not self._next_de
        return _whole(path, n_blocks)


class PeOnly:
    """basic / layerwise: the single conventional path (no second path to fall back on: with
    the PE node's SNIC down its hits cannot be read, and are recomputed)."""

    name = "pe"
    single_path = True

    def decide(self, n_blocks: int, block_bytes: float, pe_node: NodeState, de_node: NodeState) -> PathDecision:
        return PathDecision(ReadPath.PE, n_blocks, 0)


class Split:
    """dualpath-split: equalise both sides' finishing times block by block.

    `bw_of(node_id)` gives each node's SNIC drain rate in bytes/s (profiled)."""

    name = "split"

    def __init__(self, bw_of) -> None:  # bw_of: Callable[[str], float]
        self._bw_of = bw_of

    def decide(self, n_blocks: int, block_bytes: float, pe_node: NodeState, de_node: NodeState) -> PathDecision:
        pe, de = split_blocks(
            n_blocks, block_bytes, pe_node.read_q, de_node.read_q,
            self._bw_of(pe_node.node_id), self._bw_of(de_node.node_id),
        )
        if de == 0:
            return PathDecision(ReadPath.PE, pe, 0)
        if pe == 0:
            return PathDecision(ReadPath.DE, 0, de)
        return PathDecision(ReadPath.SPLIT, pe, de)
