"""PE assignment: the paper's Algorithm 1, FIFO over the waiting queue.

C1 tok_e > beta: overloaded, skipped.  C2 read_q <= alpha: short disk queue, preferred, so idle
SNICs get read work first.  C3 read_q > alpha.  Pick the least tok_e in C2, else in C3, else stop:
the head of the queue blocks the rest, which is what keeps PE assignment FIFO.

Categories are fixed for one call except that tok_e grows with every assignment (the paper updates
only tok_e inside a fetch), so an engine can drop into C1 mid-call but never moves C2 <-> C3.
Heaps keyed by (tok_e, index) make one call O(n log n) for n engines instead of O(n) per request.
"""
from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

from .records import EngineState, Request
from .thresholds import Thresholds


def category(engine: EngineState, th: Thresholds) -> int:
    """1, 2 or 3: the engine's category under Algorithm 1 right now."""
    if engine.tok > th.beta_tokens:
        return 1
    return 2 if engine.node.read_q <= th.alpha_bytes else 3


def assign_pe(
    queue: Iterable[Request], engines: Sequence[EngineState], th: Thresholds
) -> list[tuple[Request, EngineState]]:
    """Assign the longest FIFO prefix of `queue` that Algorithm 1 admits.

    Mutates each chosen engine's tok and seq so one call can assign many requests. Returns the
    (request, engine) pairs in queue order; the caller removes that many from the queue head.
    """
    beta = th.beta_tokens
    alpha = th.alpha_bytes
    c2: list[tuple[int, int, EngineState]] = []
    c3: list[tuple[int, int, EngineState]] = []
    for e in engines:
        if e.tok > beta:
            continue
        (c2 if e.node.read_q <= alpha else c3).append((e.tok, e.index, e))
    heapq.heapify(c2)
    heapq.heapify(c3)
    out: list[tuple[Request, EngineState]] = []
    for req in queue:
        heap = c2 if c2 else c3
        if not heap:
            break  # every PE overloaded: stop, FIFO
        e = heap[0][2]
        e.tok += req.total_len
        e.seq += 1
        if e.tok > beta:
            heapq.heappop(heap)
        else:
            heapq.heapreplace(heap, (e.tok, e.index, e))
        out.append((req, e))
    return out
