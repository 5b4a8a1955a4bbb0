"""Is the KV a writer sent really in the buffer? One CRC check for every reader of it."""
from __future__ import annotations

import zlib
from collections.abc import Iterable

import numpy as np


def stale(buf: np.ndarray, parts: Iterable[tuple[int, int, int]]) -> list[int]:
    """Indices of the (offset, nbytes, crc32) parts of `buf` whose bytes do not have that CRC.

    Over UCX's TCP transport a WRITE's completion, and even its notification, can reach the
    target before all of its bytes are applied there (measured here as stale 4 KiB pieces). A
    READ's completion is final, so every reader of KV that a WRITE put somewhere checks what it
    read against the writer's CRC and reads the stale parts again; the host agent checks the same
    before it persists a written-back block. This is the one check all of them use.
    """
    return [i for i, (off, n, crc) in enumerate(parts) if zlib.crc32(buf[off:off + n]) != crc]
