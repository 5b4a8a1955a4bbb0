"""Byte-budget allocators for DRAM buffers and "HBM": first fit, with peak tracking."""
from __future__ import annotations


class OutOfSpace(RuntimeError):
    pass


class ByteAllocator:
    """Hands out [offset, offset+n) ranges of a fixed-size buffer.

    Freed ranges coalesce with their neighbours. `in_use` and `peak` let a run
    report how much of the budget it needed.
    """

    def __init__(self, capacity: int, name: str = "buffer", align: int = 64):
        if capacity <= 0:
            raise ValueError(f"{name}: capacity must be positive")
        self.name, self.capacity, self.align = name, capacity, align
        self._free: list[tuple[int, int]] = [(0, capacity)]  # sorted (offset, size)
        self._used: dict[int, int] = {}
        self.in_use = 0
        self.peak = 0

    def alloc(self, nbytes: int) -> int:
        if nbytes <= 0:
            raise ValueError(f"{self.name}: cannot allocate {nbytes} bytes")
        size = -(-nbytes // self.align) * self.align
        for i, (off, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (off + size, free - size)
                self._used[off] = size
                self.in_use += size
                self.peak = max(self.peak, self.in_use)
                return off
        raise OutOfSpace(f"{self.name}: no room for {nbytes} bytes ({self.in_use} of {self.capacity} in use)")

    def free(self, off: int) -> None:
        size = self._used.pop(off)
        self.in_use -= size
        self._free.append((off, size))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for o, s in self._free:
            if merged and merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + s)
            else:
                merged.append((o, s))
        self._free = merged

    def holds(self, off: int) -> bool:
        """An area starts at `off` (alloc gave it and it is not freed yet)."""
        return off in self._used

    def reset_peak(self) -> None:
        self.peak = self.in_use
