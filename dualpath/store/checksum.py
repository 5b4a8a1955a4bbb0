"""Block payload checksums: the algorithms a block may carry and one function to compute them.

The store checks every byte it reads, so the checksum is a large share of the
read path's CPU on a small machine. New blocks carry CRC-32C (Castagnoli),
which the SSE4.2 / ARMv8 crc32 instructions compute at 12-15 GB/s here against
about 4 GB/s for zlib's CRC-32. Blocks written before the switch carry CRC-32
(algo 1); they stay readable and are checked with the algorithm their header
names, so an old store root is neither rejected nor read unchecked.

The numbers are the block file header's algo byte (emulators/kvstore/blockfile.py)
and the wire protocol's "algo" field (protocol.py): one numbering everywhere.
"""
from __future__ import annotations

import zlib
from typing import Any

from crc32c import crc32c as _crc32c
from crc32c import hardware_based

# False where the CPU lacks the instruction: crc32c then falls back to a software
# table, several times slower, and a reader is better off checking on a helper thread.
HARDWARE_CRC32C: bool = bool(hardware_based)

ALGO_CRC32 = 1  # zlib CRC-32: blocks written before CRC-32C; read only
ALGO_CRC32C = 2  # CRC-32C: every block written now
WRITE_ALGO = ALGO_CRC32C
ALGO_NAMES = {ALGO_CRC32: "CRC-32", ALGO_CRC32C: "CRC-32C"}


def is_known_algo(algo: Any) -> bool:
    # bool is an int subclass; a True on the wire is a bug, not algo 1.
    return type(algo) is int and algo in ALGO_NAMES


def checksum(data: Any, algo: int = WRITE_ALGO, value: int = 0) -> int:
    """Checksum of `data` (any contiguous buffer) with `algo`, continuing from `value`.

    Both implementations release the GIL on large buffers (crc32c from 32 KiB),
    so checks on helper threads overlap the socket thread's receive copy.
    """
    if algo == ALGO_CRC32C:
        return _crc32c(data, value)
    if algo == ALGO_CRC32:
        return zlib.crc32(data, value)
    raise ValueError(f"unknown checksum algo {algo!r}; known: {ALGO_NAMES}")
