"""What the store holds, as the frontend counts it: one object both executors keep.

The testbed's store is on disk behind host agents; asking it per request would add a round trip
to every prefix match, and the oracle mode stores nothing at all yet must hit as if it had. So
the frontend keeps this index, updated only by what the store acknowledged (or, for the oracle,
what it would have), and the tests hold it against the store itself
(tests/test_e2e.py asks the host agents which keys they can read).
"""
from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence


class StoreIndex:
    """Keys of Full Blocks a request may count as hits, and those the store acknowledged."""

    def __init__(self, keys: Iterable[Hashable] = ()) -> None:
        self.stored: set[Hashable] = set(keys)  # hits a request may count
        self.persisted: set[Hashable] = set()  # acknowledged by the store (the oracle's: none)

    def match(self, keys: Sequence[Hashable], n_prompt: int, block_size: int) -> int:
        """Leading Full Blocks of a prompt whose `keys` the store holds. At least one token is
        always a miss: the last prompt token's logits give the first output token."""
        n, most = 0, min(len(keys), (n_prompt - 1) // block_size)
        stored = self.stored
        while n < most and keys[n] in stored:
            n += 1
        return n

    def add(self, keys: Iterable[Hashable], persisted: bool) -> None:
        """Blocks that now count as hits; `persisted`: the store acknowledged them."""
        keys = list(keys)
        self.stored.update(keys)
        if persisted:
            self.persisted.update(keys)

    def discard(self, key: Hashable) -> None:
        """A block the store could not give back (missing, corrupt): no longer a hit."""
        self.stored.discard(key)
