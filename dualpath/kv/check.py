"""Is the KV a writer sent really in the buffer? One CRC (CRC-32C, the store's) for all of it."""
from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from dualpath.store.checksum import ALGO_CRC32C, checksum

if TYPE_CHECKING:
    import torch

    from dualpath.kv.layouts import BlockGeometry

REREAD_AFTER_S = 0.002  # a stale part is read again after this long (its WRITE is still landing)
REREAD_MAX_GAP_S = 0.1  # the gap doubles per re-read up to this: a part that never matches (a
# corrupting writer) must not flood the link until the timeout (measured: 9.6 GB in 60 s at 2 ms)


def crc(data: Any, value: int = 0) -> int:
    """CRC-32C of a buffer, continuing from `value` (crc(b, crc(a)) == crc(a + b)): what every
    writer of KV sends with it and every reader checks (hardware, ~15 GB/s here)."""
    return checksum(data, ALGO_CRC32C, value)


def stale(buf: np.ndarray, parts: Iterable[tuple[int, int, int]]) -> list[int]:
    """Indices of the (offset, nbytes, crc) parts of `buf` whose bytes do not have that CRC.

    Over UCX's TCP transport a WRITE's completion, and even its notification, can reach the
    target before all of its bytes are applied there (measured here as stale 4 KiB pieces). A
    READ's completion is final, so every reader of KV that a WRITE put somewhere checks what it
    read against the writer's CRC and reads the stale parts again; the host agent checks the same
    before it persists a written-back block. This is the one check all of them use.
    """
    return [i for i, (off, n, crc) in enumerate(parts) if checksum(buf[off:off + n], ALGO_CRC32C) != crc]


def layer_hash(k: "torch.Tensor", v: "torch.Tensor", geom: "BlockGeometry") -> str:
    """One layer's K and V as an engine lays them out in HBM rows, hashed: what an engine reports
    of the KV it loaded and the verification computes from its own recomputation."""
    import torch

    from dualpath.kv.layouts import pack_rows

    rows = torch.empty((k.shape[0], geom.bytes_per_token_per_layer), dtype=torch.uint8)
    pack_rows(k.detach().cpu(), v.detach().cpu(), geom, rows)
    return hashlib.blake2b(rows.numpy().tobytes(), digest_size=16).hexdigest()
