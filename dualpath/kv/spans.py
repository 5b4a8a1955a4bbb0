"""Where a request's KV lives in a remote DRAM buffer, and the descriptor lists that move it.

A request's area in a PE or DE buffer is consecutive Full Blocks
([n_layer, block_size, bytes_per_token_per_layer] each). On the engine side
("HBM") one layer's KV of n tokens is laid out as n contiguous token rows.
Moving layer l of tokens [t0, t0+n) between the two is one descriptor per
Full Block touched: this is the per-layer descriptor list posted as one batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dualpath.kv.layouts import BlockGeometry


@dataclass(frozen=True)
class Span:
    """A request's Full Blocks in a peer's registered region, starting at `offset`."""

    peer: str
    region: str
    offset: int

    @classmethod
    def from_msg(cls, d: dict) -> "Span":
        return cls(str(d["peer"]), str(d["region"]), int(d["offset"]))

    def to_msg(self) -> dict:
        return {"peer": self.peer, "region": self.region, "offset": self.offset}


def token_rows_descs(geom: BlockGeometry, layer: int, first_token: int, n_tokens: int,
                     local_offset: int, remote_offset: int) -> np.ndarray:
    """(local_off, remote_off, len) rows moving layer `layer` of tokens [first, first+n).

    Local side: n contiguous token rows from local_offset. Remote side: the
    Full-Block layout from remote_offset (block 0 holds tokens 0..block_size-1).
    """
    bpt, bs = geom.bytes_per_token_per_layer, geom.block_size
    rows = []
    t, done = first_token, 0
    while done < n_tokens:
        b, r = divmod(t, bs)
        count = min(bs - r, n_tokens - done)
        remote = remote_offset + b * geom.full_block_bytes + layer * geom.layer_block_bytes + r * bpt
        rows.append((local_offset + done * bpt, remote, count * bpt))
        t += count
        done += count
    return np.asarray(rows, dtype=np.int64).reshape(-1, 3)


def kv_bytes(geom: BlockGeometry, n_tokens: int) -> int:
    """Bytes of KV of n tokens over all layers."""
    return n_tokens * geom.kv_bytes_per_token
